"""PolyTokenizer against the `transformers` tokenizer of the same checkpoint: truncated ids, and the length
before truncation (num_input_tokens), which single texts get in one pass from the overflowing pieces."""

import pytest
from transformers import AutoTokenizer

from polyvec.tokenizer import PolyTokenizer, PromptTooLongError


@pytest.mark.parametrize("model", ["minilm_path", "mpnet_path"])  # [CLS] .. [SEP] (BERT) and <s> .. </s> (MPNet)
@pytest.mark.parametrize("max_length", [8, 31, 256])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_truncation_and_input_length_match_transformers(
    model, max_length, add_special_tokens, cranfield_texts, request
):
    path = request.getfixturevalue(model)
    ref = AutoTokenizer.from_pretrained(str(path))
    texts = cranfield_texts + ["", "one", "x " * 5000]
    ours = PolyTokenizer(path / "tokenizer.json").encode_prompts(
        texts, max_length, truncate=True, add_special_tokens=add_special_tokens
    )
    cut = ref(texts, truncation=True, max_length=max_length, add_special_tokens=add_special_tokens)["input_ids"]
    full = ref(texts, add_special_tokens=add_special_tokens)["input_ids"]
    assert any(len(f) > max_length for f in full) and any(len(f) <= max_length for f in full)
    for o, c, f in zip(ours, cut, full):
        assert o.input_ids == c
        assert o.num_input_tokens == len(f)


def test_pairs_and_refusal_keep_their_paths(minilm_path, cranfield_texts):
    tok = PolyTokenizer(minilm_path / "tokenizer.json")
    ref = AutoTokenizer.from_pretrained(str(minilm_path))
    pairs = [("a short query", cranfield_texts[1]), (cranfield_texts[2], "x")]
    ours = tok.encode_prompts(pairs, 64, truncate=True)
    cut = ref([p[0] for p in pairs], [p[1] for p in pairs], truncation="longest_first", max_length=64)
    full = ref([p[0] for p in pairs], [p[1] for p in pairs])
    for o, i, t, f in zip(ours, cut["input_ids"], cut["token_type_ids"], full["input_ids"]):
        assert (o.input_ids, o.token_type_ids, o.num_input_tokens) == (i, t, len(f))
    with pytest.raises(PromptTooLongError):
        tok.encode_prompts(["short", "x " * 300], 64, truncate=False)


def test_truncation_shorter_than_the_special_tokens_keeps_the_first_tokens(minilm_path):
    """`tokenizers` does not cut at all when max_length cannot hold [CLS] and [SEP]; polyvec keeps the first
    max_length tokens, as it cuts token-id prompts (truncate_prompt_tokens=1 gave 5 tokens)."""
    tok = PolyTokenizer(minilm_path / "tokenizer.json")
    one = tok.encode_prompts(["hello big world", "x"], 1, truncate=True)
    assert [p.input_ids for p in one] == [[101], [101]] and [p.num_input_tokens for p in one] == [5, 3]
    pair = tok.encode_prompts([("a query", "a document")], 1, truncate=True)[0]
    assert pair.input_ids == [101] and pair.num_input_tokens == 7  # [CLS] a query [SEP] a document [SEP]
    assert [p.input_ids for p in tok.encode_prompts(["hello big world"], 2, truncate=True)] == [[101, 102]]


def test_get_tokenizer_answers_as_a_transformers_tokenizer(minilm_llm, minilm_path):
    """Code written against vLLM's `LLM.get_tokenizer()` (a transformers tokenizer) runs unchanged: encode,
    calling it, tokenize, the id/token conversions and decode give what transformers gives."""
    tok, ref = minilm_llm.get_tokenizer(), AutoTokenizer.from_pretrained(str(minilm_path))
    text, pair, long = "Hello, Wing Flutter!", "a second text", "word " * 700
    assert tok.encode(text) == ref.encode(text) and tok.encode(text, add_special_tokens=False) == ref.encode(
        text, add_special_tokens=False
    )
    assert tok.encode(text, pair) == ref.encode(text, pair)
    assert tok.encode(long, truncation=True) == ref.encode(long, truncation=True)  # model_max_length
    assert tok.encode(long, truncation=True, max_length=9) == ref.encode(long, truncation=True, max_length=9)
    assert len(tok.encode(long)) == len(ref.encode(long)) > 512
    for args in ([text], [[text, long, ""]], [[text, "b"], [pair, pair]]):
        want = ref(*args, truncation=True, max_length=16)
        assert tok(*args, truncation=True, max_length=16) == {k: want[k] for k in want}
    assert tok.tokenize(text) == ref.tokenize(text)
    ids = ref.encode(text)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[1]) == ref.convert_ids_to_tokens(ids[1])
    assert tok.convert_tokens_to_ids(["hello", "[SEP]"]) == ref.convert_tokens_to_ids(["hello", "[SEP]"])
    assert tok.decode(ids) == ref.decode(ids) and tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, True)
    assert tok.batch_decode([ids, ids[:2]]) == ref.batch_decode([ids, ids[:2]])
    assert len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    with pytest.raises(TypeError, match="a text"):
        tok.encode([1, 2])


def test_clean_up_of_decoded_text_follows_the_tokenizer_config(tmp_path, splade_path, minilm_path):
    """vLLM's /detokenize is transformers' decode: SPLADE-tiny's config asks for clean_up_tokenization_spaces
    ("don't", not "don ' t"); MiniLM's does not; on a BPE tokenizer transformers skips it unless forced."""
    import json

    text = "Don't stop, it's fine. Isn't it? We've won!"
    for path in (splade_path, minilm_path):
        ref = AutoTokenizer.from_pretrained(str(path))
        ours = PolyTokenizer(path / "tokenizer.json")
        ids = ref(text)["input_ids"]
        assert ours.clean_up(ours.decode(ids)) == ref.decode(ids), path
    assert PolyTokenizer(splade_path / "tokenizer.json").clean_up_spaces
    assert not PolyTokenizer(minilm_path / "tokenizer.json").clean_up_spaces

    from tokenizers import Tokenizer, models, pre_tokenizers

    bpe = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.save(str(tmp_path / "tokenizer.json"))
    config = {"clean_up_tokenization_spaces": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert not PolyTokenizer(tmp_path / "tokenizer.json").clean_up_spaces
    config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert PolyTokenizer(tmp_path / "tokenizer.json").clean_up_spaces


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_text_of_megabytes_is_cut_from_a_part_as_from_the_whole(minilm_path, cranfield_texts, side):
    """A text being cut was tokenized whole first: 14 MB took 5 s and 1.9 GB. One over 256 Ki characters is now
    read in part, up to a word boundary (a space between two other characters: words tokenize on their own);
    where there is none nearby (one long word, a run of spaces) it falls back to the whole text. The ids are
    transformers' either way, also where characters Python calls whitespace are control characters BERT's
    normalizer drops (form feeds of PDF text: a check by str.isspace joined words across them)."""
    ref = AutoTokenizer.from_pretrained(str(minilm_path), truncation_side=side)
    ours = PolyTokenizer(minilm_path / "tokenizer.json")
    prose = " ".join(cranfield_texts)
    texts = [
        (prose * (300_000 // len(prose) + 1))[:300_000],  # read in part
        "x" * 300_000,  # one word: no whitespace after the kept tokens, the whole text
        "a " + " " * 300_000 + prose[:3000],  # no word boundary near the cut: the whole text
        ("ab\x0c" * 60 + "cd x " + "ef\x1c" * 8 + " ") * 1400,  # words joined across dropped control characters
    ]
    got = ours.encode_prompts(texts, 64, truncate=True, truncation_side=side)
    want = ref(texts, truncation=True, max_length=64)["input_ids"]
    assert [g.input_ids for g in got] == want
    full = [len(ids) for ids in ref(texts)["input_ids"]]
    assert 64 < got[0].num_input_tokens < full[0] and got[1].num_input_tokens == full[1]  # a part's own length
    assert got[2].num_input_tokens == full[2] and 64 < got[3].num_input_tokens < full[3]
    # refused as too long (--truncation error, TEI's truncate false) from its part, which already has too many
    with pytest.raises(PromptTooLongError, match="input 0 has at least") as part:
        ours.encode_prompts(texts[:1], 64, truncate=False, truncation_side=side)
    assert part.value.at_least and 64 < part.value.num_tokens < full[0]
    with pytest.raises(PromptTooLongError) as whole:  # no word boundary near the cut: counted whole
        ours.encode_prompts(texts[2:3], 64, truncate=False, truncation_side=side)
    assert not whole.value.at_least and whole.value.num_tokens == full[2]


def test_a_part_cut_on_the_left_keeps_no_token_of_its_first_word(tmp_path):
    """Cut on the left, a huge text's part begins with the space before a word; a tokenizer that strips it
    (a Strip normalizer) read that word as "bar" where the whole text has "▁bar", and kept it when the part
    held exactly the tokens to keep. Only tokens after the part's first word are kept from a part now."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "bar": 3, "▁bar": 4}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Strip()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    text = "z" * 1000 + " bar" + (" " + "q" * 999) * 262  # 263,004 characters: read in part
    ref = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ref.enable_truncation(265, direction="left")
    got = PolyTokenizer(tmp_path / "tokenizer.json").encode_prompts([text], 265, True, True, "left")[0]
    assert got.input_ids == ref.encode(text).ids and got.input_ids[1] == 4


def test_vllms_tokenizer_surface(minilm_path, tmp_path):
    """LLM.get_tokenizer() is vLLM's TokenizerLike to its users (vLLM's ner_offline example reads
    all_special_tokens); polyvec's lacked most of it. Each value is transformers' for the same files."""
    import json
    import shutil

    from polyvec import LLM

    folder = tmp_path / "tok"
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["[unused0]", "[unused1]"]
    config["chat_template"] = "{% for m in messages %}[CLS] {{ m['role'] }}: {{ m['content'] }} [SEP]{% endfor %}"
    config["truncation_side"] = "left"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for path in (minilm_path, folder):
        ours = PolyTokenizer(path / "tokenizer.json")
        ref = AutoTokenizer.from_pretrained(str(path))
        for name in ("all_special_tokens", "all_special_ids", "bos_token_id", "eos_token_id", "pad_token_id",
                     "is_fast", "truncation_side"):  # fmt: skip
            assert getattr(ours, name) == getattr(ref, name), (path, name)
        assert ours.max_token_id == max(ref.get_vocab().values())
        if path == minilm_path:  # transformers registers the config's extra special tokens as added ones at load
            assert ours.get_added_vocab() == ref.get_added_vocab()
        assert [ours.num_special_tokens_to_add(p) for p in (False, True)] == [
            ref.num_special_tokens_to_add(p) for p in (False, True)]  # fmt: skip
        tokens = ref.tokenize("Hello, unbelievable flutter!")
        assert ours.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens)
    chat = [{"role": "user", "content": "wing flutter"}, {"role": "assistant", "content": "heat"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)
    want = ref.apply_chat_template(chat)  # ids by default; transformers 5: in a BatchEncoding, vLLM's protocol: a list
    assert ours.apply_chat_template(chat) == (want["input_ids"] if "input_ids" in want else want)
    assert LLM(str(minilm_path)).get_tokenizer().all_special_tokens == ["[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]"]


@pytest.mark.parametrize("tokenizer_file", ["tokenizer.json", "vocab.txt"])
def test_tokens_declared_only_in_the_configs_are_added_as_transformers_adds_them(tmp_path, minilm_path, tokenizer_file):
    """Extra special tokens, a named special token and an added token that only tokenizer_config.json declares:
    transformers adds the missing ones when it loads the tokenizer (a vocabulary token keeps its id, a new one is
    numbered after the vocabulary), so a text holding them is one token each, not split into pieces."""
    import json
    import shutil

    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(minilm_path / name, tmp_path / name)
    if tokenizer_file == "vocab.txt":
        (tmp_path / "tokenizer.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = ["<extra>", "[unused0]"]
    config["mask_token"] = "<mymask>"
    decoder = config.get("added_tokens_decoder") or {}
    decoder["30600"] = {"content": "<dec>", "lstrip": False, "rstrip": False, "normalized": False,
                        "single_word": False, "special": False}  # fmt: skip
    config["added_tokens_decoder"] = decoder
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").unlink()

    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = PolyTokenizer(tmp_path / tokenizer_file)
    text = "hello [unused0] world <extra> x <mymask> <dec> y"
    assert ours.token_ids(text)[0] == ref(text)["input_ids"]
    assert ref.convert_ids_to_tokens(ref(text)["input_ids"])[2:5] == ["[unused0]", "world", "<extra>"]
    assert ours.vocab_size == len(ref)
    assert ours.all_special_tokens == ref.all_special_tokens


def test_the_transformers_surface_follows_the_tokenizer_config(tmp_path, minilm_path, splade_path):
    """What LLM.get_tokenizer() answers as transformers does: truncation on tokenizer_config's side (it cut on
    the right), decode cleaned up where the config asks (SPLADE-tiny's: "don ' t"), transformers 5's
    extra_special_tokens among all_special_tokens, and an empty text_pair is no pair."""
    import json
    import shutil

    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(minilm_path / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(truncation_side="left", extra_special_tokens=["[unused1]", "<xq>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ref, ours = AutoTokenizer.from_pretrained(str(tmp_path)), PolyTokenizer(tmp_path / "tokenizer.json")
    text = "one two three four five six seven eight nine ten eleven twelve"
    assert ours.encode(text, truncation=True, max_length=6) == ref.encode(text, truncation=True, max_length=6)
    assert (
        ours(text, truncation=True, max_length=6)["input_ids"] == ref(text, truncation=True, max_length=6)["input_ids"]
    )
    assert ours.all_special_tokens == ref.all_special_tokens and "<xq>" in ours.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    assert ours("Hello world", "")["input_ids"] == ref("Hello world", "")["input_ids"] == [101, 7592, 2088, 102]

    ref, ours = AutoTokenizer.from_pretrained(str(splade_path)), PolyTokenizer(splade_path / "tokenizer.json")
    ids = ref.encode("I don't think it's they're, really.")
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert ours.batch_decode([ids], skip_special_tokens=skip) == ref.batch_decode([ids], skip_special_tokens=skip)
    assert ours.decode(ids, clean_up_tokenization_spaces=False) == ref.decode(ids, clean_up_tokenization_spaces=False)


def test_special_tokens_map_wins_where_the_configs_disagree(tmp_path, minilm_path):
    """special_tokens_map.json's [MASK] against tokenizer_config.json's <MyMask>: transformers takes the first;
    polyvec took the second (and, adding it as a token, changed a text's ids)."""
    import json
    import shutil

    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copy(minilm_path / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "mask_token": "<MyMask>"}))
    ref, ours = AutoTokenizer.from_pretrained(str(tmp_path)), PolyTokenizer(tmp_path / "tokenizer.json")
    text = "hello <MyMask> world [MASK]"
    assert ours.token_ids(text)[0] == ref(text)["input_ids"]
    assert ours.special_token_id("mask_token") == ref.mask_token_id == 103
    assert ours.vocab_size == len(ref) and ours.all_special_tokens == ref.all_special_tokens


def test_a_vocab_txt_tokenizer_has_berts_special_tokens_by_default(tmp_path, minilm_path):
    """Only vocab.txt and a tokenizer_config.json naming no special token: transformers' BertTokenizer defaults
    ([CLS], [SEP], [PAD], ...), where polyvec had none (no pad id, no special tokens)."""
    import json
    import shutil

    shutil.copy(minilm_path / "vocab.txt", tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": True, "tokenizer_class": "BertTokenizer"})
    )
    ref, ours = AutoTokenizer.from_pretrained(str(tmp_path)), PolyTokenizer(tmp_path / "vocab.txt")
    assert ours.pad_token_id == ref.pad_token_id == 0
    assert ours.all_special_tokens == ref.all_special_tokens and ours.all_special_ids == ref.all_special_ids
    assert ours.token_ids("hello [MASK] world")[0] == ref("hello [MASK] world")["input_ids"]


@pytest.mark.parametrize(
    "variant", ["cased_config", "lowercase_default", "added_tokens_json", "vocab_specials", "no_class_modernbert"]
)
def test_folder_variants_tokenize_as_transformers(tmp_path, minilm_path, variant):
    """A folder whose tokenizer_config.json and tokenizer.json disagree on lowercasing (transformers' BERT
    tokenizers follow the config's do_lower_case, true where it says none), an older added_tokens.json, and a
    vocab.txt-only tokenizer with its own [CLS] / [SEP]: each tokenized otherwise than transformers; a folder
    naming no tokenizer class is read by its model_type, as transformers picks the class."""
    import json
    import shutil

    folder = tmp_path / variant
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx"))

    def edit(name, change):
        path = folder / name
        path.write_text(json.dumps(change(json.loads(path.read_text()))))

    if variant == "cased_config":
        edit("tokenizer_config.json", lambda c: {**c, "do_lower_case": False})
    elif variant == "lowercase_default":
        edit("tokenizer.json", lambda t: {**t, "normalizer": {**t["normalizer"], "lowercase": False}})
        edit("tokenizer_config.json", lambda c: {k: v for k, v in c.items() if k != "do_lower_case"})
    elif variant == "no_class_modernbert":  # no class named: transformers picks it by model_type, not BERT's here
        edit("tokenizer.json", lambda t: {**t, "normalizer": {**t["normalizer"], "lowercase": False}})
        edit(
            "tokenizer_config.json",
            lambda c: {k: v for k, v in c.items() if k not in ("do_lower_case", "tokenizer_class")},
        )
        edit("config.json", lambda c: {**c, "model_type": "modernbert"})
    elif variant == "added_tokens_json":
        (folder / "added_tokens.json").write_text('{"[unused1]": 2}')
    else:
        (folder / "tokenizer.json").unlink()
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            edit(name, lambda c: {**c, "cls_token": "[unused0]", "sep_token": "[unused2]"})
    texts = ["Hello World, Über CAFÉ naïve [unused1] token 中文", "wing FLUTTER"]
    file = folder / ("vocab.txt" if variant == "vocab_specials" else "tokenizer.json")
    ours = [e.input_ids for e in PolyTokenizer(file).encode_prompts(texts, 256, True)]
    assert ours == AutoTokenizer.from_pretrained(str(folder))(texts)["input_ids"]
