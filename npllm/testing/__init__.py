"""npllm.testing: property-test your own sampler with npllm's laws.

    from npllm.testing import check_filter, check_sampler

    check_filter(my_top_p, "top_p")          # every law of top-p, Hypothesis search, minimal failing example
    check_sampler(my_sample)                 # chi-square goodness of fit against softmax, seed reproducibility
    check_constraint(bound, token_bytes, in_language, stops)   # a structured-output constraint's laws
    check_masked_sampler(my_sample)          # the constraint stage: masked never drawn, the rest renormalised

check_filter and the strategies need Hypothesis (`pip install -e ".[testing]"` in npllm's folder); check_sampler needs only
NumPy. `import npllm` never imports this package. docs/testing.md lists every law.
"""

from .sampler import check_sampler

__all__ = ["check_filter", "check_law", "check_case", "check_sampler", "check_constraint", "check_masked_sampler",
           "laws_of", "KINDS", "CONVENTIONS", "LawFailure", "strategies"]

_NEEDS_HYPOTHESIS = {"check_filter", "check_law", "check_case", "check_constraint", "check_masked_sampler",
                     "laws_of", "KINDS", "CONVENTIONS", "LawFailure", "Law", "laws", "strategies"}


def __getattr__(name):
    """check_filter and friends import Hypothesis on first use, so check_sampler works without it."""
    if name not in _NEEDS_HYPOTHESIS:
        raise AttributeError(f"module 'npllm.testing' has no attribute {name!r}")
    try:
        import hypothesis  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"npllm.testing.{name} needs Hypothesis: pip install hypothesis (or, in npllm's folder, pip install -e '.[testing]')"
        ) from err
    import importlib

    if name in ("laws", "strategies"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("check_constraint", "check_masked_sampler"):
        return getattr(importlib.import_module(f"{__name__}.constraint_laws"), name)
    module = "check" if name in ("check_filter", "check_law", "check_case") else "laws"
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
