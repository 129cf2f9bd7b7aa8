"""PoolingParams validation: one test per rule, each checking the message names the parameter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from polyvec import PoolerConfig, PoolingParams

EMBED = ("embed", "token_embed")
CLS = ("classify",)


@pytest.fixture(scope="module")
def cfg(minilm_llm):
    return minilm_llm.model_config


def verify(params, task, cfg, tasks=EMBED):
    return params.verify(task, cfg, tasks)


def test_defaults_resolve_task_and_activation(cfg):
    p = verify(PoolingParams(), "embed", cfg)
    assert p.task == "embed" and p.use_activation is True and p.dimensions is None


def test_unsupported_task_lists_supported(cfg):
    with pytest.raises(ValueError, match=r"Unsupported task: 'classify' is not .* it supports: embed, token_embed"):
        verify(PoolingParams(), "classify", cfg)


def test_unknown_task(cfg):
    with pytest.raises(
        ValueError,
        match=r"task='generate' is not a pooling task; allowed: embed, token_embed, "
        r"classify, token_classify",
    ):
        verify(PoolingParams(), "generate", cfg)


def test_removed_tasks_in_vllms_words(cfg):
    with pytest.raises(ValueError, match="^`encode` task was removed; use `token_embed` or `token_classify` instead.$"):
        verify(PoolingParams(), "encode", cfg)
    with pytest.raises(ValueError, match="^`score` task was removed; use `classify` instead.$"):
        verify(PoolingParams(), "score", cfg)
    # refused when built, as vLLM's PoolingParams and PoolerConfig refuse them, not when first used
    for task, message in (("score", "`score` task was removed"), ("encode", "`encode` task was removed")):
        with pytest.raises(ValueError, match=message):
            PoolingParams(task=task)
    for value in (False, True, None):
        with pytest.raises(ValueError, match="^Parameter `normalize` was removed; use `use_activation` instead.$"):
            PoolerConfig(normalize=value)  # type: ignore[call-arg]
    assert PoolerConfig(task="embed").to_dict() == {"task": "embed"}


def test_vllms_internal_fields_are_accepted(cfg, minilm_llm):
    """Code that builds PoolingParams as vLLM 0.34's own code does (all its fields) runs unchanged."""
    p = PoolingParams(dimensions=None, use_activation=True, task="embed", requires_token_ids=True,
                      skip_reading_prefix_cache=True, late_interaction_params=None, extra_kwargs={"a": 1},
                      output_kind=None)  # fmt: skip
    assert verify(p, "embed", cfg).requires_token_ids is True
    got = minilm_llm.embed("flutter", pooling_params=p, use_tqdm=False)[0].outputs.embedding
    assert got == minilm_llm.embed("flutter", use_tqdm=False)[0].outputs.embedding


def test_missing_task(cfg):
    with pytest.raises(ValueError, match="task must be given"):
        verify(PoolingParams(), None, cfg)


def test_conflicting_task(cfg):
    with pytest.raises(ValueError, match=r"task='token_embed' in PoolingParams conflicts"):
        verify(PoolingParams(task="token_embed"), "embed", cfg)


def test_softmax_is_rejected_with_pointer(cfg):
    with pytest.raises(ValueError, match="softmax .* use use_activation"):
        verify(PoolingParams(softmax=True), "embed", cfg)


def test_normalize_alias(cfg):
    assert verify(PoolingParams(normalize=False), "embed", cfg).use_activation is False
    assert verify(PoolingParams(normalize=True), "token_embed", cfg).use_activation is True


def test_normalize_rejected_on_classify(cfg):
    with pytest.raises(ValueError, match=r"normalize is only valid for the embed, token_embed tasks"):
        verify(PoolingParams(normalize=True), "classify", cfg, CLS)


def test_activation_alias_and_rejection(cfg):
    assert verify(PoolingParams(activation=False), "classify", cfg, CLS).use_activation is False
    with pytest.raises(ValueError, match=r"activation is only valid for the classify, token_classify tasks"):
        verify(PoolingParams(activation=True), "embed", cfg)


def test_alias_conflict(cfg):
    with pytest.raises(ValueError, match="normalize=False conflicts with use_activation=True"):
        verify(PoolingParams(normalize=False, use_activation=True), "embed", cfg)


def test_dimensions_rejected_on_classify(cfg):
    with pytest.raises(ValueError, match="dimensions is only valid for the embed and token_embed tasks"):
        verify(PoolingParams(dimensions=8), "classify", cfg, CLS)


def test_dimensions_need_matryoshka(cfg):
    with pytest.raises(
        ValueError,
        match=r"dimensions=128 is not allowed: this model was not trained for "
        r"Matryoshka .* full size 384",
    ):
        verify(PoolingParams(dimensions=128), "embed", cfg)
    assert verify(PoolingParams(dimensions=384), "embed", cfg).dimensions == 384


def test_dimensions_range_when_matryoshka(cfg):
    mcfg = replace(cfg, is_matryoshka=True)
    assert verify(PoolingParams(dimensions=64), "embed", mcfg).dimensions == 64
    for bad in (0, 385, -3):
        with pytest.raises(ValueError, match=rf"dimensions={bad} is out of range; allowed: 1..384"):
            verify(PoolingParams(dimensions=bad), "embed", mcfg)
    with pytest.raises(ValueError, match="dimensions must be an integer"):
        verify(PoolingParams(dimensions="64"), "embed", mcfg)


def test_dimensions_must_be_in_matryoshka_list(cfg):
    mcfg = replace(cfg, is_matryoshka=True, matryoshka_dimensions=(64, 128, 384))
    assert verify(PoolingParams(dimensions=128), "embed", mcfg).dimensions == 128
    with pytest.raises(
        ValueError, match="dimensions=100 is not one of this model's Matryoshka dimensions: 64, 128, 384"
    ):
        verify(PoolingParams(dimensions=100), "embed", mcfg)


def test_truncate_prompt_tokens_rules(cfg):
    assert verify(PoolingParams(truncate_prompt_tokens=-1), "embed", cfg).truncate_prompt_tokens == 256
    assert verify(PoolingParams(truncate_prompt_tokens=10), "embed", cfg).truncate_prompt_tokens == 10
    with pytest.raises(
        ValueError,
        match=r"truncate_prompt_tokens=300 is larger than the model's maximum input "
        r"length max_model_len=256; allowed: -1 or 1..256",
    ):
        verify(PoolingParams(truncate_prompt_tokens=300), "embed", cfg)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be -1 .* or between 1 and 256"):
            verify(PoolingParams(truncate_prompt_tokens=bad), "embed", cfg)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer"):
        verify(PoolingParams(truncate_prompt_tokens=2.5), "embed", cfg)


def test_step_options_only_for_token_tasks(cfg):
    with pytest.raises(ValueError, match="step_tag_id and returned_token_ids apply to STEP pooling"):
        verify(PoolingParams(step_tag_id=5), "embed", cfg)
    with pytest.raises(ValueError, match="returned_token_ids must be a non-empty list"):
        verify(PoolingParams(returned_token_ids=[]), "token_embed", cfg)


def test_pooler_config_supplies_defaults(cfg):
    c = replace(cfg, pooler_config=PoolerConfig(use_activation=False), is_matryoshka=True)
    assert verify(PoolingParams(), "embed", c).use_activation is False
    assert verify(PoolingParams(use_activation=True), "embed", c).use_activation is True
    c = replace(cfg, pooler_config=PoolerConfig(dimensions=32), is_matryoshka=True)
    assert verify(PoolingParams(), "embed", c).dimensions == 32


def test_pooler_config_validation():
    with pytest.raises(ValueError, match="pooling_type='AVG' is not valid; allowed: CLS, LAST, MEAN"):
        PoolerConfig(pooling_type="avg")
    assert PoolerConfig(pooling_type="mean").pooling_type == "MEAN"
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolerConfig(dimensions=0)


def test_booleans_are_booleans_and_step_settings_are_token_ids(cfg):
    """A string such as "no" used to read as true; a STEP tag of "x" gave an empty tensor."""
    for field in ("use_activation", "normalize", "return_tokens"):
        with pytest.raises(ValueError, match=f"{field} must be true or false, got 'no'"):
            verify(PoolingParams(**{field: "no"}), "embed", cfg)
    with pytest.raises(ValueError, match="step_tag_id must be a non-negative integer"):
        verify(PoolingParams(step_tag_id="x"), "token_embed", cfg)
    for bad in (5, [True], []):
        with pytest.raises(ValueError, match="returned_token_ids must be a non-empty list"):
            verify(PoolingParams(returned_token_ids=bad), "token_embed", cfg)


def test_pooler_step_settings_apply_to_token_tasks_only(cfg):
    """A pooler_config's step_tag_id / returned_token_ids are STEP pooling of token tasks: embed keeps its own
    pooling (and its long-input windows); they made every embed request fail or cut it short."""
    stepped = replace(cfg, pooler_config=PoolerConfig(step_tag_id=2088, returned_token_ids=[99999]))
    embed = verify(PoolingParams(), "embed", stepped)
    assert embed.step_tag_id is None and embed.returned_token_ids is None
    token = verify(PoolingParams(), "token_embed", stepped)
    assert token.step_tag_id == 2088 and token.returned_token_ids == [99999]
