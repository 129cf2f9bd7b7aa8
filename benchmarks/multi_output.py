"""bge-m3's three outputs (dense, sparse, multi-vector): one multi-output pass against the same outputs asked for
separately, and against FlagEmbedding's BGEM3FlagModel on the same weights and texts.

    python benchmarks/multi_output.py [--layers 12] [--hidden 768] [--limit 400] [--repeats 2] [--dtype float32]
                                     [--no-separate] [--no-flagembedding]

No bge-m3 checkpoint can be had here: the model is bge-m3-shaped (an XLM-RoBERTa trunk with its 250,002-token
vocabulary, seeded random weights, colbert_linear.pt and sparse_linear.pt beside it; fewer layers than bge-m3's
24 by default) with MiniLM's tokenizer. Runs interleaved in one process; texts are Cranfield's passages.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, hardware, load_passages  # noqa: E402

TASKS = ["embed", "embed_sparse", "token_embed"]


def build(folder: Path, layers: int, hidden: int) -> None:
    import shutil

    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from polyvec.resolve import resolve_model_path

    torch.manual_seed(0)
    cfg = transformers.XLMRobertaConfig(
        vocab_size=250002, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        intermediate_size=4 * hidden, max_position_embeddings=514, pad_token_id=1, type_vocab_size=1,
    )  # fmt: skip
    transformers.XLMRobertaModel(cfg).eval().save_pretrained(folder, safe_serialization=True)
    minilm = resolve_model_path("sentence-transformers/all-MiniLM-L6-v2")
    shutil.copy(minilm / "tokenizer.json", folder / "tokenizer.json")
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "eos_token": "[SEP]", "pad_token": "[PAD]"}
    special |= {"unk_token": "[UNK]", "mask_token": "[MASK]", "tokenizer_class": "PreTrainedTokenizerFast"}
    special["model_max_length"] = 512
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    torch.save(torch.nn.Linear(hidden, hidden).state_dict(), folder / "colbert_linear.pt")
    torch.save(torch.nn.Linear(hidden, 1).state_dict(), folder / "sparse_linear.pt")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--limit", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-flagembedding", action="store_true")
    ap.add_argument("--no-separate", action="store_true", help="skip the three-requests system (float32 runs)")
    ap.add_argument("--dtype", default="auto", help="polyvec's dtype (FlagEmbedding runs float32)")
    args = ap.parse_args()
    texts = load_passages(("cranfield",), args.limit)
    from polyvec import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bge-m3-shaped"
        build(folder, args.layers, args.hidden)
        llm = LLM(str(folder), dtype=args.dtype)
        flag = None
        if not args.no_flagembedding:
            from FlagEmbedding import BGEM3FlagModel

            flag = BGEM3FlagModel(str(folder), use_fp16=False, devices="cpu")
        llm.encode(texts[:16], pooling_task=TASKS, use_tqdm=False)  # warm-up
        times: dict[str, list[float]] = {"multi": [], "separate": [], "flagembedding": []}
        for r in range(args.repeats):
            order = ["multi", "separate", "flagembedding"] if r % 2 == 0 else ["flagembedding", "separate", "multi"]
            for name in order:
                t0 = time.perf_counter()
                if name == "multi":
                    llm.encode(texts, pooling_task=TASKS, use_tqdm=False)
                elif name == "separate":
                    if args.no_separate:
                        continue
                    for task in TASKS:
                        llm.encode(texts, pooling_task=task, use_tqdm=False)
                elif flag is not None:
                    flag.encode(texts, batch_size=32, max_length=512, return_dense=True, return_sparse=True,
                                return_colbert_vecs=True)  # fmt: skip
                else:
                    continue
                times[name].append(time.perf_counter() - t0)
    print(
        f"## bge-m3-shaped, {args.layers} layers x {args.hidden}, vocabulary 250,002; {len(texts)} Cranfield passages"
    )
    print(f"{time.strftime('%Y-%m-%d')}, {hardware()}; polyvec dtype {llm.model_config.dtype}\n")
    print("| system | seconds per repeat | texts/s (best) |")
    print("|---|---|---|")
    for name, label in (
        ("multi", "polyvec, three outputs in one pass"),
        ("separate", "polyvec, three requests"),
        ("flagembedding", "FlagEmbedding BGEM3FlagModel, float32, all three"),
    ):
        if times[name]:
            print(f"| {label} | {', '.join(f'{t:.1f}' for t in times[name])} | {len(texts) / min(times[name]):.1f} |")
    sep = [s / m for s, m in zip(times["separate"], times["multi"])]
    if sep:
        print(f"\nseparate / multi per repeat: {', '.join(f'{x:.2f}' for x in sep)}")
    if times["flagembedding"]:
        fe = [f / m for f, m in zip(times["flagembedding"], times["multi"])]
        print(f"FlagEmbedding / polyvec multi per repeat: {', '.join(f'{x:.2f}' for x in fe)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
