"""Embeddings (npllm.embed): held to transformers on a Qwen3-Embedding-shaped checkpoint (tests/fixtures/hf/
qwen3_embedding, scripts/fixtures/make_embedding_fixtures.py), the pooling read from the model's files, the laws of
pooling and normalizing, and every way in: LLM.embed, `npllm embed`, the server's /v1/embeddings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npllm
from npllm.cli import main
from npllm.embed import l2_normalize, pool
from npllm.errors import ConfigError, FormatError, GenerationError
from npllm.formats import read_checkpoint
from npllm.formats.gguf_write import write_gguf
from npllm.serve.app import Limits, Server
from test_serve import KEY, running

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "qwen3_embedding"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
HIDDEN = np.load(FIXTURE / "reference.npz")


def reference(i: int, pooling: str, normalize: bool) -> np.ndarray:
    """What sentence-transformers computes from transformers' last_hidden_state of text i."""
    h = HIDDEN[f"hidden_{i}"].astype(np.float64)
    e = {"last": h[-1], "mean": h.mean(axis=0), "cls": h[0]}[pooling]
    return e / np.linalg.norm(e) if normalize else e


@pytest.fixture(scope="module", params=["numpy", "numba"])
def llm(request):
    return npllm.load(FIXTURE, backend=request.param)


def cosine(a, b) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_pooling_is_read_from_the_sentence_transformers_files(llm):
    assert (llm.config.pooling, llm.config.normalize_embeddings) == ("last", True)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_match_transformers(llm, pooling, normalize):
    """Each text's vector against transformers' hidden states pooled as sentence-transformers pools them: cosine
    >= 0.99999 and every value within 1e-4."""
    vectors = llm.embed(REFERENCE["texts"], pooling=pooling, normalize=normalize)
    assert vectors.shape == (len(REFERENCE["texts"]), llm.config.dim) and vectors.dtype == np.float32
    for i, v in enumerate(vectors):
        want = reference(i, pooling, normalize)
        assert cosine(v, want) >= 0.99999
        np.testing.assert_allclose(v, want, atol=1e-4, rtol=0)


def test_texts_encode_as_the_tokenizers_library_does_and_ids_embed_as_their_text(llm):
    for text, ids in zip(REFERENCE["texts"], REFERENCE["ids"]):
        assert llm.tokenizer.encode(text, bos=True) == ids
    np.testing.assert_array_equal(llm.embed(REFERENCE["ids"]), llm.embed(REFERENCE["texts"]))
    np.testing.assert_array_equal(llm.embed(REFERENCE["ids"][1]), llm.embed(REFERENCE["texts"][1]))


def test_a_batch_gives_each_input_its_solo_embedding(llm):
    texts = REFERENCE["texts"]
    together = llm.embed(texts + texts[::-1])
    alone = np.stack([llm.embed(t)[0] for t in texts])
    np.testing.assert_array_equal(together[:len(texts)], alone)
    np.testing.assert_array_equal(together[len(texts):], alone[::-1])


@pytest.mark.parametrize("inputs, message", [
    ([[]], "embed takes"), ([], "embed takes"), ([[1, 2, 10 ** 6]], "outside the vocabulary"),
    ([[1] * 200], "longer than the model's context"), ([1.5], "embed takes"), (["a", 3], "embed takes"),
    ([[True, 1]], "embed takes"),
])
def test_bad_inputs_are_clear_errors(inputs, message):
    llm = npllm.load(FIXTURE, backend="numpy")
    with pytest.raises(GenerationError, match=message):
        llm.embed(inputs)
    with pytest.raises(GenerationError, match="pooling 'max'"):
        llm.embed("a", pooling="max")


# ---------------------------------------------------------------------------------------------------------------- laws

rows = hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
                  elements=st.floats(-100, 100, width=32))


@settings(max_examples=60, deadline=None)
@given(rows)
def test_pooling_laws(h):
    """last and cls pick a row; mean lies in the rows' bounding box and is the row itself for identical rows."""
    np.testing.assert_array_equal(pool(h, "last"), h[-1])
    np.testing.assert_array_equal(pool(h, "cls"), h[0])
    m = pool(h, "mean")
    assert np.all(m >= h.min(axis=0) - 1e-4) and np.all(m <= h.max(axis=0) + 1e-4)
    same = np.repeat(h[:1], len(h), axis=0)
    np.testing.assert_allclose(pool(same, "mean"), h[0], rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-1e3, 1e3, width=32)),
       st.floats(0.01, 100))
def test_normalize_laws(e, scale):
    """Unit length (a zero vector stays zero), idempotent, blind to positive scaling."""
    n = l2_normalize(e)
    if np.linalg.norm(e.astype(np.float64)) < 1e-6:
        return
    assert abs(np.linalg.norm(n.astype(np.float64)) - 1) < 1e-5
    np.testing.assert_allclose(l2_normalize(n), n, atol=1e-6)
    np.testing.assert_allclose(l2_normalize((e * np.float32(scale)).astype(np.float32)), n, atol=1e-5)


# ---------------------------------------------------------------------------------------------- what the files say


def test_a_pooling_npllm_does_not_compute_is_refused_and_no_modules_file_says_nothing(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(FIXTURE, copy)
    (copy / "modules.json").unlink()
    config, _ = read_checkpoint(copy)
    assert (config.pooling, config.normalize_embeddings) == ("", False)
    shutil.copy(FIXTURE / "modules.json", copy)
    settings_file = copy / "1_Pooling" / "config.json"
    pooling = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps(pooling | {"pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling pooling_mode_max_tokens is not one npllm computes"):
        read_checkpoint(copy)
    settings_file.write_text(json.dumps(pooling | {"pooling_mode_mean_tokens": True}))
    with pytest.raises(ConfigError, match="pooling_mode_mean_tokens, pooling_mode_lasttoken"):
        read_checkpoint(copy)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_gguf_pooling_type_is_written_and_read_back(tmp_path, stories260k, pooling):
    """llama.cpp's `<arch>.pooling_type`; its embeddings are unit length by default, so a GGUF's are too."""
    config, weights = read_checkpoint(stories260k)
    write_gguf(tmp_path / "m.gguf", config.replace(pooling=pooling), weights)
    back, _ = read_checkpoint(tmp_path / "m.gguf")
    assert (back.pooling, back.normalize_embeddings) == (pooling, True)
    write_gguf(tmp_path / "plain.gguf", config, weights)
    assert read_checkpoint(tmp_path / "plain.gguf")[0].pooling == ""


# ------------------------------------------------------------------------------------------------------ the CLI


def test_npllm_embed_writes_one_json_line_per_text(tmp_path, capsys):
    texts = REFERENCE["texts"][:3]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["embed", "--model", str(FIXTURE), "--backend", "numpy", "-i", str(tmp_path / "in.txt")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    want = npllm.load(FIXTURE, backend="numpy").embed(texts)
    np.testing.assert_array_equal(np.array([line["embedding"] for line in lines], np.float32), want)
    assert main(["embed", "--model", str(FIXTURE), "--backend", "numpy", "-i", str(tmp_path / "in.txt"),
                 "--pooling", "mean", "--no-normalize"]) == 0
    mean = np.array([json.loads(line)["embedding"] for line in capsys.readouterr().out.splitlines()], np.float32)
    np.testing.assert_array_equal(mean, npllm.load(FIXTURE, backend="numpy").embed(texts, "mean", False))


def test_npllm_embed_refuses_an_empty_line_in_one_line(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a\n\nb\n", encoding="utf-8")
    assert main(["embed", "--model", str(FIXTURE), "--backend", "numpy", "-i", str(tmp_path / "in.txt")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "line 2 is empty" in captured.err


# --------------------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client():
    llm = npllm.load(FIXTURE, backend="numpy")
    server = Server(llm, "qwen3-embedding", Limits(max_slots=2, max_queue=8, max_tokens_limit=64), None,
                    api_key=KEY)
    with running(server) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60), llm


def test_v1_embeddings_through_the_official_client(client):
    """The client asks for base64 by default and decodes it; float is asked for explicitly."""
    client, llm = client
    texts = REFERENCE["texts"]
    want = llm.embed(texts)
    answer = client.embeddings.create(model="qwen3-embedding", input=texts)
    assert [d.index for d in answer.data] == list(range(len(texts)))
    np.testing.assert_array_equal(np.array([d.embedding for d in answer.data], np.float32), want)
    assert answer.usage.prompt_tokens == sum(len(ids) for ids in REFERENCE["ids"])
    floats = client.embeddings.create(model="qwen3-embedding", input=texts[0], encoding_format="float")
    np.testing.assert_array_equal(np.array(floats.data[0].embedding, np.float32), want[0])
    ids = client.embeddings.create(model="qwen3-embedding", input=REFERENCE["ids"][:2], encoding_format="float")
    np.testing.assert_array_equal(np.array([d.embedding for d in ids.data], np.float32), want[:2])


@pytest.mark.parametrize("fields, param", [
    (dict(input=""), "input"), (dict(input=[]), "input"), (dict(input=[["a"]]), "input"),
    (dict(input="a", dimensions=8), "dimensions"), (dict(input="a", encoding_format="int8"), "encoding_format"),
    (dict(input=[[10 ** 6]]), "input"), (dict(input="a", model="other"), "model"),
])
def test_v1_embeddings_bad_fields_are_errors_naming_them(client, fields, param):
    client, _ = client
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(**{"model": "qwen3-embedding", **fields})
    assert e.value.status_code in (400, 404) and e.value.body["param"] == param


@pytest.mark.parametrize("modules, pooling, message", [
    ("not json", None, "cannot read as JSON"), ('{"a": 1}', None, "not a list of module objects"),
    ('[1, 2]', None, "not a list of module objects"),
    ('[{"type": "sentence_transformers.models.Pooling", "path": "nowhere"}]', None, "settings are missing"),
    ('[{"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]', "[]", "settings are missing"),
])
def test_malformed_sentence_transformers_files_are_one_clear_error(tmp_path, modules, pooling, message):
    copy = tmp_path / "model"
    shutil.copytree(FIXTURE, copy)
    (copy / "modules.json").write_text(modules)
    if pooling is not None:
        (copy / "1_Pooling" / "config.json").write_text(pooling)
    with pytest.raises((ConfigError, FormatError), match=message):
        read_checkpoint(copy)
