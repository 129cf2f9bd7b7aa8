"""Configuration reading, including real-checkpoint layouts and quirks (resolution: test_resolve.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyvec import LLM, PoolingParams
from polyvec.loader import _st_pooling_modes, load_model_config
from tests.helpers import TINY, cosine_rows, save_tiny_model


def test_st_pooling_mode_formats():
    assert _st_pooling_modes({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}) == ("CLS", "MEAN")
    assert _st_pooling_modes({"pooling_mode": "lasttoken"}) == ("LAST",)
    assert _st_pooling_modes({"pooling_mode": ["weightedmean", "mean_sqrt_len_tokens"]}) == (
        "WEIGHTED_MEAN",
        "MEAN_SQRT_LEN",
    )
    with pytest.raises(ValueError, match="unknown sentence-transformers pooling mode"):
        _st_pooling_modes({"pooling_mode": "median"})
    with pytest.raises(ValueError, match="selects no pooling mode"):
        _st_pooling_modes({"pooling_mode_mean_tokens": False})


def test_minilm_config(minilm_path):
    cfg = load_model_config(minilm_path, dtype=torch.float32)
    assert cfg.architecture == "BertModel" and cfg.st_pooling == ("MEAN",)
    assert cfg.max_model_len == 256 and cfg.sources["max_model_len"].startswith("sentence_bert_config")
    assert cfg.max_position_len == 512 and cfg.embed_dim == 384
    cfg = load_model_config(minilm_path, dtype=torch.float32, max_model_len=512)
    assert cfg.max_model_len == 512 and cfg.sources["max_model_len"] == "argument"
    with pytest.raises(ValueError, match=r"max_model_len=600 is out of range; this model allows 1..512"):
        load_model_config(minilm_path, dtype=torch.float32, max_model_len=600)


def test_position_limit_of_fairseq_models(tmp_path, minilm_path):
    folder = save_tiny_model(
        "XLMRobertaModel",
        "XLMRobertaConfig",
        tmp_path,
        minilm_path,
        **dict(TINY, pad_token_id=1, type_vocab_size=1, max_position_embeddings=130),
    )
    cfg = load_model_config(folder, dtype=torch.float32)
    assert cfg.max_model_len == 128 and cfg.sources["max_model_len"].startswith("config.json")


def test_classifier_activation_rules(tmp_path, minilm_path):
    def cfg_for(**extra):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        save_tiny_model("BertForSequenceClassification", "BertConfig", folder, minilm_path, **TINY, **extra)
        return load_model_config(folder, dtype=torch.float32)

    assert cfg_for(num_labels=3).classifier_activation == "softmax"
    assert cfg_for(num_labels=1).classifier_activation == "sigmoid"
    assert cfg_for(num_labels=3, problem_type="multi_label_classification").classifier_activation == "sigmoid"
    ce = cfg_for(num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert ce.classifier_activation == "identity"


def test_cross_encoder_saved_by_sentence_transformers(tmp_path, minilm_path):
    """sentence-transformers 5+ `CrossEncoder.save` writes activation_fn to config_sentence_transformers.json
    (not config.json): scores as CrossEncoder.predict gives them (the sigmoid was applied on top)."""
    from sentence_transformers import CrossEncoder

    folder = save_tiny_model(
        "BertForSequenceClassification", "BertConfig", tmp_path / "ce", minilm_path, num_labels=1, **TINY
    )
    CrossEncoder(str(folder), activation_fn=torch.nn.Identity()).save(str(tmp_path / "saved"))
    pairs = [("wing flutter", "flutter of a swept wing"), ("wing flutter", "heat transfer")]
    want = CrossEncoder(str(tmp_path / "saved")).predict(pairs)
    llm = LLM(str(tmp_path / "saved"), dtype="float32")
    assert llm.model_config.classifier_activation == "identity"
    got = [o.outputs.score for o in llm.score("wing flutter", [d for _, d in pairs], use_tqdm=False)]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)


def test_legacy_sentence_transformers_subfolder_layout(tmp_path, minilm_path, minilm_llm):
    """Old ST layouts keep the transformer in 0_Transformer/ with its own config and weights."""
    root = tmp_path / "legacy"
    shutil.copytree(minilm_path, root / "0_Transformer", ignore=shutil.ignore_patterns("1_Pooling", "modules.json"))
    shutil.copytree(minilm_path / "1_Pooling", root / "1_Pooling")
    (root / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    llm = LLM(str(root), dtype="float32")
    assert llm.model_config.transformer_dir == root / "0_Transformer"
    a = llm.embed("legacy layout", use_tqdm=False)[0].outputs.data
    b = minilm_llm.embed("legacy layout", use_tqdm=False)[0].outputs.data
    assert torch.allclose(a, b, atol=1e-6)


def test_pytorch_bin_weights_and_missing_prefix(tmp_path, minilm_path, minilm_llm):
    """A .bin checkpoint whose keys carry the task prefix ("bert.") loads like the safetensors one."""
    from safetensors.torch import load_file

    folder = tmp_path / "bin"
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    state = {f"bert.{k}": v for k, v in load_file(minilm_path / "model.safetensors").items()}
    torch.save(state, folder / "pytorch_model.bin")
    llm = LLM(str(folder), dtype="float32")
    a = llm.embed("weights from a pickle", use_tqdm=False)[0].outputs.data
    b = minilm_llm.embed("weights from a pickle", use_tqdm=False)[0].outputs.data
    assert cosine_rows(a[None], b[None]).item() >= 0.999999


def test_missing_weights_are_reported(tmp_path, minilm_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(minilm_path, folder)
    state = load_file(folder / "model.safetensors")
    del state["encoder.layer.3.output.dense.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"no weights for: encoder\.layers\.3\.ffn_down\.weight"):
        LLM(str(folder))


def test_unsupported_architecture(tmp_path, minilm_path):
    folder = tmp_path / "gpt"
    shutil.copytree(minilm_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "modules.json").unlink()
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported; supported: BertModel"):
        LLM(str(folder))


TEXTS = ["What is the lift of a WING at Mach 2?", "Café au lait, naïve résumé", "flutter", "x " * 300]


def _st_folder(tmp_path, minilm_path, name, pooling=None, normalize=True, st_config=None, drop=()):
    """MiniLM as a sentence-transformers folder with another Pooling config, Normalize module or model config."""
    folder = tmp_path / name
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("model.safetensors", *drop))
    (folder / "model.safetensors").symlink_to(minilm_path / "model.safetensors")
    modules = json.loads((minilm_path / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules if normalize else modules[:2]))
    if pooling is not None:
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384, **pooling}))
    if st_config is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return folder


def _st_vectors(folder, texts, **kwargs):
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(folder), device="cpu").encode(texts, **kwargs))


def _vectors(llm, texts, **kwargs):
    params = PoolingParams(**kwargs) if kwargs else None
    return torch.stack([o.outputs.data for o in llm.embed(texts, params, use_tqdm=False)])


def test_normalized_only_with_a_normalize_module(tmp_path, minilm_path):
    """As sentence-transformers and vLLM 0.34 (its get_pooling_config): without a Normalize module in
    modules.json the pooled vector is returned as it is (dot-product models); use_activation still asks for it."""
    for pooling in ({"pooling_mode": "mean"}, {"pooling_mode": "cls"}):
        folder = _st_folder(tmp_path, minilm_path, pooling["pooling_mode"], pooling, normalize=False)
        llm = LLM(str(folder), dtype="float32")
        got, want = _vectors(llm, TEXTS), _st_vectors(folder, TEXTS)
        assert want.norm(dim=1).min() > 2  # not unit vectors
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
        assert torch.allclose(_vectors(llm, TEXTS, use_activation=True).norm(dim=1), torch.ones(len(TEXTS)))
        assert llm.model_config.sources["use_activation"] == "modules.json (no Normalize module)"


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "lasttoken", "weightedmean", "mean_sqrt_len_tokens"])
def test_include_prompt_false_pools_after_the_prompt(tmp_path, minilm_path, mode):
    """`include_prompt: false` (INSTRUCTOR-style models): the prompt's tokens ([CLS] and the prompt, as
    sentence-transformers counts them) are left out of pooling, but still attended to."""
    prompts = {"query": "Represent the aerodynamics question for retrieval: ", "document": ""}
    folder = _st_folder(
        tmp_path,
        minilm_path,
        mode,
        {"pooling_mode": mode, "include_prompt": False},
        st_config={"prompts": prompts, "default_prompt_name": None},
    )
    llm = LLM(str(folder), dtype="float32")
    got = _vectors(llm, TEXTS, input_type="query")
    want = _st_vectors(folder, TEXTS, prompt_name="query")
    assert cosine_rows(got, want).min() >= 0.9999
    together = _vectors(llm, TEXTS + TEXTS[:2])  # no prompt named: all tokens pooled; batch-independent
    assert cosine_rows(together[: len(TEXTS)], _st_vectors(folder, TEXTS)).min() >= 0.9999
    mixed = llm.embed(TEXTS[:2], [PoolingParams(input_type=t) for t in ("query", "document")], use_tqdm=False)
    assert cosine_rows(mixed[0].outputs.data[None], got[:1]).item() >= 0.99999


def test_truncate_dim_of_the_model_config(tmp_path, minilm_path):
    folder = _st_folder(tmp_path, minilm_path, "truncated", st_config={"truncate_dim": 64})
    llm = LLM(str(folder), dtype="float32")
    got, want = _vectors(llm, TEXTS), _st_vectors(folder, TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 64)
    assert cosine_rows(got, want).min() >= 0.9999
    assert _vectors(llm, TEXTS, dimensions=384).shape == (len(TEXTS), 384)  # a request may still ask for more
    # sentence-transformers cuts sentence embeddings only: its token embeddings keep the full width
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS[0], output_value="token_embeddings")
    tokens = llm.token_embed(TEXTS[0], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.data
    assert tokens.shape == tuple(ref.shape) == (len(ref), 384)
    assert cosine_rows(tokens, torch.as_tensor(ref)).min() >= 0.9999


def _dense(folder, name, module_input=None, module_output=None):
    """A sentence-transformers Dense module 384 → 128 (Tanh) in `folder`/`name`."""
    import safetensors.torch

    (folder / name).mkdir()
    cfg = {"in_features": 384, "out_features": 128, "bias": True,
           "activation_function": "torch.nn.modules.activation.Tanh"}  # fmt: skip
    if module_input:
        cfg["module_input_name"] = module_input
    if module_output:
        cfg["module_output_name"] = module_output
    (folder / name / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    weights = {"linear.weight": torch.randn(128, 384, generator=g) * 0.05, "linear.bias": torch.zeros(128)}
    safetensors.torch.save_file(weights, str(folder / name / "model.safetensors"))
    return {"idx": 9, "name": name, "path": name, "type": "sentence_transformers.models.Dense"}


@pytest.mark.parametrize(
    "case",
    [
        "layernorm",
        "normalize_before_dense",
        "token_dense_before_pooling",
        "dense_to_another_output",
        "prompt_name",
        "own_pooling",
    ],
)
def test_sentence_transformers_layouts_it_would_compute_otherwise_are_refused(tmp_path, minilm_path, case):
    """Modules polyvec does not compute were skipped (a LayerNorm module: cosine 0.67 to sentence-transformers),
    modules out of the order polyvec runs them were run in its order (Normalize before a Dense: 0.77), a Dense over
    token vectors before Pooling was left out of embed (384-d, not 128), one writing another output was applied,
    and an unknown default_prompt_name was ignored. Each is refused by name now."""
    folder = _st_folder(tmp_path, minilm_path, case)
    modules = json.loads((folder / "modules.json").read_text())  # Transformer, Pooling, Normalize
    if case == "layernorm":
        modules.insert(2, {"idx": 2, "name": "2_LayerNorm", "path": "2_LayerNorm",
                           "type": "sentence_transformers.models.LayerNorm"})  # fmt: skip
        match = r"module 2 \(sentence_transformers.models.LayerNorm, 2_LayerNorm\) is not supported"
    elif case == "normalize_before_dense":
        modules.append(_dense(folder, "3_Dense"))
        match = "a Normalize module before Dense"
    elif case == "token_dense_before_pooling":
        modules.insert(1, _dense(folder, "1b_Dense", module_input="token_embeddings"))
        match = "a Dense over token embeddings before Pooling"
    elif case == "dense_to_another_output":
        modules.insert(2, _dense(folder, "2_Dense", module_output="projected"))
        match = "a Dense writing 'projected'"
    elif case == "prompt_name":
        (folder / "config_sentence_transformers.json").write_text(
            json.dumps({"prompts": {"query": "query: "}, "default_prompt_name": "doc"})
        )
        match = r"default_prompt_name 'doc' is not among the prompts \(query\)"
    elif case == "own_pooling":  # remote code named like the built-in: it was run as sentence-transformers' Pooling
        modules[1]["type"] = "custom_st.Pooling"
        match = r"module 1 \(custom_st.Pooling, 1_Pooling\) is code of its own, not sentence-transformers'"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), dtype="float32")


def test_a_dropout_module_is_read_as_nothing(tmp_path, minilm_path):
    folder = _st_folder(tmp_path, minilm_path, "dropout")
    modules = json.loads((folder / "modules.json").read_text())
    modules.insert(
        2, {"idx": 2, "name": "2_Dropout", "path": "2_Dropout", "type": "sentence_transformers.models.Dropout"}
    )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "2_Dropout").mkdir()
    (folder / "2_Dropout" / "config.json").write_text(json.dumps({"dropout": 0.2}))
    got = _vectors(LLM(str(folder), dtype="float32"), TEXTS)
    assert cosine_rows(got, _st_vectors(folder, TEXTS)).min() >= 0.9999


def test_vocab_txt_tokenizer_reads_its_casing(tmp_path, minilm_path):
    """A folder with vocab.txt and no tokenizer.json: do_lower_case (and strip_accents) from tokenizer_config.json,
    as transformers' BertTokenizer reads them."""
    folder = _st_folder(tmp_path, minilm_path, "cased", drop=("tokenizer.json",))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "do_lower_case": False}))
    got, want = _vectors(LLM(str(folder), dtype="float32"), TEXTS), _st_vectors(folder, TEXTS)
    assert cosine_rows(got, want).min() >= 0.9999
    lower = _vectors(LLM(str(minilm_path), dtype="float32"), TEXTS)
    assert cosine_rows(got[:2], lower[:2]).max() < 0.99  # the cased text reads differently


def test_the_tokenizers_truncation_side_is_the_default(tmp_path, minilm_path):
    """tokenizer_config.json's truncation_side "left": a long text keeps its last tokens, as sentence-transformers
    and vLLM cut it unless a request names a side (polyvec cut on the right)."""
    folder = _st_folder(tmp_path, minilm_path, "left")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "truncation_side": "left"}))
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    text = " ".join(f"word{i} wing" for i in range(400))
    llm = LLM(str(folder), dtype="float32")
    out = llm.embed(text, use_tqdm=False)[0]
    assert out.prompt_token_ids == st.tokenize([text])["input_ids"][0].tolist()
    assert cosine_rows(out.outputs.data[None], torch.as_tensor(st.encode([text]))).item() >= 0.9999
    right = llm.embed(text, tokenization_kwargs={"truncation_side": "right"}, use_tqdm=False)[0]
    assert right.prompt_token_ids[1:4] == llm.get_tokenizer()("word0 wing")["input_ids"][1:4]
    cfg["truncation_side"] = "middle"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="truncation_side must be 'left' or 'right', got 'middle'"):
        LLM(str(folder), dtype="float32")


def test_a_transformer_config_under_its_older_name_is_read(tmp_path, minilm_path):
    """sentence_distilbert_config.json and its kin (checkpoints from before sentence_bert_config.json), which
    sentence-transformers and vLLM read in turn: its max_seq_length was ignored."""
    folder = _st_folder(tmp_path, minilm_path, "legacy", drop=("sentence_bert_config.json",))
    (folder / "sentence_distilbert_config.json").write_text(json.dumps({"max_seq_length": 12, "do_lower_case": False}))
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.max_model_len == 12
    assert llm.model_config.sources["max_model_len"] == "sentence_distilbert_config.json max_seq_length"
    assert cosine_rows(_vectors(llm, TEXTS), _st_vectors(folder, TEXTS)).min() >= 0.9999


def test_a_dense_module_activation_as_sentence_transformers_loads_it(tmp_path, minilm_path, caplog):
    """No activation_function in a Dense config is Dense's default, Tanh (it was identity); a path
    outside torch, which sentence-transformers does not import, is Tanh too, with a warning (it was the last
    name's activation, ReLU)."""
    import logging

    for name, activation in (("absent", None), ("untrusted", "mypkg.acts.ReLU")):
        folder = _st_folder(tmp_path, minilm_path, name)
        modules = json.loads((folder / "modules.json").read_text())
        dense = _dense(folder, "2_Dense")
        cfg = json.loads((folder / "2_Dense" / "config.json").read_text())
        cfg.pop("activation_function")
        if activation is not None:
            cfg["activation_function"] = activation
        (folder / "2_Dense" / "config.json").write_text(json.dumps(cfg))
        (folder / "modules.json").write_text(json.dumps([*modules[:2], dense, modules[2]]))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyvec.loader"):
            llm = LLM(str(folder), dtype="float32")
        assert llm.model_config.dense[0].activation == "tanh", name
        assert ("is not torch's; Tanh" in caplog.text) == (activation is not None), caplog.text
        assert cosine_rows(_vectors(llm, TEXTS), _st_vectors(folder, TEXTS)).min() >= 0.9999, name


def test_a_truncate_dim_past_the_vector_cuts_nothing(tmp_path, minilm_path):
    """truncate_dim 1000 on 384-d vectors: sentence-transformers' cut keeps all 384; every request was a 400
    naming `dimensions`, a field no one had sent."""
    folder = _st_folder(tmp_path, minilm_path, "wide", st_config={"truncate_dim": 1000})
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.truncate_dim is None and not llm.model_config.is_matryoshka
    got = _vectors(llm, TEXTS)
    assert got.shape == (len(TEXTS), 384)
    assert cosine_rows(got, _st_vectors(folder, TEXTS)).min() >= 0.9999
    with pytest.raises(ValueError, match="dimensions"):  # still not a Matryoshka model
        _vectors(llm, TEXTS, dimensions=64)


def test_a_similarity_other_than_cosine_is_said(tmp_path, minilm_path, caplog):
    """Scores are cosines, as vLLM's; a model naming dot (without a Normalize module), euclidean or manhattan
    scores otherwise in sentence-transformers: a warning at load says so (it was silent)."""
    import logging

    for name, normalize, warned in (("dot", False, True), ("dot", True, False), ("euclidean", True, True),
                                    ("cosine", True, False)):  # fmt: skip
        folder = _st_folder(tmp_path, minilm_path, f"{name}-{normalize}", normalize=normalize,
                            st_config={"similarity_fn_name": name})  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyvec.loader"):
            load_model_config(str(folder), dtype=torch.float32)
        assert ("score and rerank return cosines" in caplog.text) == warned, (name, normalize, caplog.text)
