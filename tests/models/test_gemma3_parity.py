"""Gemma 3 text as EmbeddingGemma runs it (bidirectional, local layers windowed both ways) against transformers'
Gemma3TextModel and sentence-transformers on tiny seeded weights (no Gemma checkpoint or tokenizer can be had here:
MiniLM's tokenizer stands in)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyvec import LLM, PoolingParams
from tests.helpers import cosine_rows

LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8,
             query_pre_attn_scalar=12, use_bidirectional_attention=True)  # fmt: skip
LENGTHS = (30, 3, 17, 9, 5)  # past and within the local layers' window


def save_gemma3(folder, tokenizer_from, **extra):
    import transformers

    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(transformers.Gemma3TextConfig(**{**GEMMA, **extra})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # its norms scale by (1 + w), w at 0: perturbed so a norm read as w alone fails
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1000, 30000, (n,), generator=g).tolist() for n in LENGTHS]


def check_hidden_states(llm: LLM, model) -> None:
    ps = prompts()
    outs = llm.token_embed([{"prompt_token_ids": p} for p in ps], PoolingParams(use_activation=False), use_tqdm=False)
    for p, out in zip(ps, outs):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([p])).last_hidden_state[0]
        assert (out.outputs.data - want).abs().max() <= 1e-4, len(p)


@pytest.mark.parametrize("extra", [{}, {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 24}])
def test_hidden_states_match_transformers(tmp_path, minilm_path, extra):
    """Local layers attend both ways within the window (transformers halves config.json's), global ones to the
    whole prompt, each turning positions at its own rope base; queries scaled by query_pre_attn_scalar. A head_dim
    other than hidden / heads (24 against 32) was taken for 32 in choosing the packed kernel, which refused it:
    every request failed."""
    model = save_gemma3(tmp_path, minilm_path, layer_types=LAYERS, **extra)
    llm = LLM(str(tmp_path), dtype="float32")
    assert (llm.model_config.architecture, llm.supported_tasks) == ("Gemma3TextModel", ("embed", "token_embed"))
    check_hidden_states(llm, model)


def test_a_transformers_4_config(tmp_path, minilm_path):
    """rope_theta + rope_local_base_freq + rope_scaling (the global layers'), layers by sliding_window_pattern."""
    import transformers

    save_gemma3(tmp_path, minilm_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        config.pop(key)
    config |= {"rope_theta": 50000.0, "rope_local_base_freq": 500.0, "sliding_window_pattern": 2,
               "rope_scaling": {"rope_type": "linear", "factor": 4.0}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = transformers.Gemma3TextModel.from_pretrained(str(tmp_path)).eval()
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.model_config.max_model_len == 512  # vLLM does not stretch Gemma 3's by the linear factor
    check_hidden_states(llm, model)


def test_embeddinggemma_layout_matches_sentence_transformers(tmp_path, minilm_path):
    """EmbeddingGemma's modules: mean pooling, two Dense layers without bias or activation, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    save_gemma3(tmp_path / "m", minilm_path, layer_types=LAYERS)
    torch.manual_seed(2)
    modules = [Transformer(str(tmp_path / "m"), max_seq_length=48), Pooling(64, "mean"),
               Dense(64, 128, bias=False, activation_function=torch.nn.Identity()),
               Dense(128, 64, bias=False, activation_function=torch.nn.Identity()), Normalize()]  # fmt: skip
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(tmp_path / "st"))
    texts = ["the wing stalls at high angle of attack", "shock", "heat transfer in laminar boundary layers " * 6]
    llm = LLM(str(tmp_path / "st"), dtype="float32")
    got = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    assert cosine_rows(got, st.encode(texts, convert_to_tensor=True)).min() >= 0.9999


def test_what_cannot_run_is_refused_at_load(tmp_path, minilm_path):
    """A causal Gemma 3; float16 (vLLM's words: it was accepted); a layer type's rope that polyvec cannot run
    (it loaded, then every request failed)."""
    save_gemma3(tmp_path / "causal", minilm_path, use_bidirectional_attention=False)
    with pytest.raises(ValueError, match="needs use_bidirectional_attention: true"):
        LLM(str(tmp_path / "causal"), dtype="float32")
    save_gemma3(tmp_path / "m", minilm_path, layer_types=LAYERS)
    with pytest.raises(ValueError, match="'gemma3_text' does not support float16. Reason: Numerical instability"):
        LLM(str(tmp_path / "m"), dtype="float16")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_parameters"]["full_attention"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="full_attention rope type 'dynamic' \\(config.json\\) is not supported"):
        LLM(str(tmp_path / "m"), dtype="float32")
