"""Pooling outputs as Arrow columns and `encode_to_parquet`: the file holds, row by row and in input order, what
`LLM.encode` returns, in the column types `polyvec embed --ray` writes."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from polyvec.columns import TOKEN_BATCH_SIZE, encode_to_parquet, output_columns, token_rows

TEXTS = [f"passage {i} about " + "wing flutter and " * (i % 7) + "heat transfer" for i in range(37)]


def test_token_and_embed_columns_equal_encode(minilm_llm, tmp_path):
    path = tmp_path / "out.parquet"
    seen = []
    ids = [f"d{i}" for i in range(len(TEXTS))]
    n = encode_to_parquet(minilm_llm, ids, TEXTS, str(path), ["token_embed", "embed"], batch_size=8, on_row=seen.append)
    assert n == len(TEXTS) == len(seen)
    file = pq.ParquetFile(path)
    assert [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)] == [8, 8, 8, 8, 5]
    table = file.read()
    assert table.column_names == ["id", "text", "token_embed", "embed"]
    assert table.column("id").to_pylist() == ids and table.column("text").to_pylist() == TEXTS
    assert str(table.schema.field("token_embed").type) == "list<element: fixed_size_list<element: float>[384]>"
    assert str(table.schema.field("embed").type) == "fixed_size_list<element: float>[384]"
    tokens = token_rows(table.column("token_embed"))
    embeds = table.column("embed").combine_chunks().values.to_numpy().reshape(len(TEXTS), 384)
    want = zip(minilm_llm.token_embed(TEXTS, use_tqdm=False), minilm_llm.embed(TEXTS, use_tqdm=False))
    for i, (t, e) in enumerate(want):
        assert tokens[i].shape == tuple(t.outputs.data.shape), i
        assert np.allclose(tokens[i], t.outputs.data.numpy(), atol=1e-5), i
        assert np.allclose(embeds[i], e.outputs.data.numpy(), atol=1e-5), i


def test_one_task_column_and_default_row_groups(minilm_llm, tmp_path):
    path = tmp_path / "tokens.parquet"
    texts = TEXTS * 8  # 296 rows: one full default row group of per-token outputs and the rest
    assert encode_to_parquet(minilm_llm, [str(i) for i in range(len(texts))], texts, str(path), "token_embed") == 296
    file = pq.ParquetFile(path)
    assert [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)] == [TOKEN_BATCH_SIZE, 40]
    assert file.schema_arrow.names == ["id", "text", "token_embed"]


def test_output_column_names(minilm_llm):
    outs = minilm_llm.encode(TEXTS[:3], pooling_task=["token_embed", "embed"], use_tqdm=False)
    assert list(output_columns(["token_embed", "embed"], outs)) == ["token_embed", "embed"]
    assert list(output_columns(["token_embed", "embed"], outs, "v")) == ["v_token_embed", "v_embed"]
    one = minilm_llm.embed(TEXTS[:3], use_tqdm=False)
    assert list(output_columns("embed", one)) == ["embed"] and list(output_columns("embed", one, "v")) == ["v"]


def test_refuses_ids_that_do_not_match(minilm_llm, tmp_path):
    with pytest.raises(ValueError, match="2 texts, 1 ids"):
        encode_to_parquet(minilm_llm, ["a"], TEXTS[:2], str(tmp_path / "x.parquet"))
    assert not (tmp_path / "x.parquet").exists()


def test_token_codes_and_muvera_columns(minilm_llm):
    """token_encoding keeps its integers (int8 codes with a scales column, binary's packed bytes) and MUVERA is one
    vector per row: the codes were written as float vectors without their scales (unreadable) and MUVERA failed
    with an IndexError (`PolyvecEncoder(pooling_params=...)`, Ray Data's way to pass them)."""
    import pyarrow as pa

    from polyvec import PoolingParams

    texts = TEXTS[:5]
    for encoding, dtype, width in (("int8", pa.int8(), 384), ("binary", pa.uint8(), 48)):
        outs = minilm_llm.token_embed(texts, PoolingParams(token_encoding=encoding), use_tqdm=False)
        cols = output_columns("token_embed", outs, "vectors")
        assert cols["vectors"].type == pa.list_(pa.list_(dtype, width))
        for row, out in zip(token_rows(cols["vectors"]), outs):
            assert np.array_equal(row, out.outputs.codes.codes.numpy())
        if encoding == "int8":
            scales = cols["vectors_scales"].to_pylist()
            assert [np.float32(s) for s in scales[0]] == list(outs[0].outputs.codes.scales.numpy())
        else:
            assert set(cols) == {"vectors"}
    muvera = minilm_llm.token_embed(texts, PoolingParams(muvera={}), use_tqdm=False)
    col = output_columns("token_embed", muvera)["token_embed"]
    assert col.type == pa.list_(pa.float32(), 10240)
    assert np.array_equal(col.values.to_numpy().reshape(5, -1), np.stack([o.outputs.data.numpy() for o in muvera]))


def test_one_score_per_token_is_a_width_of_one(minilm_path, tmp_path):
    """bge-m3's token_classify gives one weight per token ([n], not [n, labels]): the column was taken for an
    embed's and written as a fixed-size list of the first row's length (Arrow refused a batch of other lengths,
    or, all alike, the rows came back in the wrong shape). It is list<fixed_size_list<float32, 1>> now."""
    from polyvec import LLM
    from tests.helpers import save_tiny_m3

    llm = LLM(str(save_tiny_m3(tmp_path / "m3", minilm_path)), dtype="float32")
    texts = ["a b", "a b c d", "heat"]
    path = tmp_path / "t.parquet"
    assert encode_to_parquet(llm, ["x", "y", "z"], texts, str(path), "token_classify", batch_size=2) == 3
    table = pq.read_table(path)
    assert str(table.schema.field("token_classify").type) == "list<element: fixed_size_list<element: float>[1]>"
    want = llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
    for got, w in zip(token_rows(table.column("token_classify")), want):
        assert w.outputs.data.ndim == 1 and np.allclose(got[:, 0], w.outputs.data.numpy(), atol=1e-6)
