"""docs/architectures.md says what is true: its tables list every architecture the Hugging Face reader knows, the
ModelConfig options each row names cover the options its fixture's config uses, and each backend cell says "yes"
exactly where that backend runs the fixture (the backend class's FEATURES), so the page changes with the code."""

import dataclasses
import re
from pathlib import Path

import pytest

from npllm.config import ModelConfig
from npllm.formats.hf import read_hf
from npllm.formats.hf_families import FAMILIES
from npllm.models.base import Model
from npllm.models.cuda import CudaTransformer
from npllm.models.numba import NumbaTransformer
from npllm.models.reference import Transformer

REPO = Path(__file__).resolve().parent.parent
PAGE = (REPO / "docs" / "architectures.md").read_text(encoding="utf-8")
FIXTURES = REPO / "tests" / "fixtures" / "hf"
CONFIG_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
BACKENDS = {"numpy": Transformer, "numba": NumbaTransformer, "cuda": CudaTransformer}


def table(first_header: str) -> list[dict]:
    """The rows of the page's Markdown table whose header row starts with `first_header`, as {column: cell}."""
    lines = PAGE.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} "))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def arch_of(row: dict, column: str) -> str:
    return re.match(r"`([a-z0-9_]+)`", row[column]).group(1)


CHANGES = {arch_of(r, "arch (config.json `model_type`)"): r["what it changes from Llama"]
           for r in table("arch (config.json")}
RUNS = {arch_of(r, "arch"): r for r in table("arch |")}
# each row's first fixture: the checkpoint its backend cells and options are held to
FIXTURE_OF = {arch: m.group(1) for arch, r in RUNS.items()
              if (m := re.match(r"`([a-z0-9_]+)`", r["verified by (fixture in tests/fixtures/hf/)"]))}


def test_every_architecture_the_reader_knows_is_in_both_tables():
    assert set(CHANGES) == set(FAMILIES) == set(RUNS)


@pytest.mark.parametrize("arch", sorted(FIXTURE_OF))
def test_the_options_named_for_an_architecture_cover_its_fixture(arch):
    config, _ = read_hf(FIXTURES / FIXTURE_OF[arch])
    assert config.arch == arch
    named = set(re.findall(r"`([a-z_]+)`", CHANGES[arch])) | ({"longrope"} if '"longrope"' in CHANGES[arch] else set())
    assert config.features <= named, f"{arch}: the page does not name {sorted(config.features - named)}"
    assert named <= set(CONFIG_FIELDS) | {"longrope", "rope_scaling"}, "a name that is no ModelConfig field"


@pytest.mark.parametrize("arch", sorted(FIXTURE_OF))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_backend_cells_say_yes_exactly_where_the_backend_runs_the_fixture(arch, backend):
    config, _ = read_hf(FIXTURES / FIXTURE_OF[arch])
    runs = config.features <= BACKENDS[backend].FEATURES
    cell = RUNS[arch][backend]
    assert cell.split()[0] == ("yes" if runs else "no"), (
        f"docs/architectures.md: the {backend} cell of {arch} says {cell!r}, but the {backend} backend "
        f"{'runs' if runs else 'refuses'} it (missing: {sorted(config.features - BACKENDS[backend].FEATURES)})")


def test_every_backend_applies_the_head_options():
    """The page says every backend applies logit_multiplier and final_logit_softcap in its lm_head."""
    assert {"logit_multiplier", "final_logit_softcap"} <= Model.FEATURES
    assert all(Model.FEATURES <= cls.FEATURES for cls in BACKENDS.values())
