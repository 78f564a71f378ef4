"""Manifest job throughput on a Dolma-like text corpus, tokenized on the fly by a real-sized BPE.

No tokenizer can be downloaded here, so one of real size is trained: a GPT-2-style byte-level BPE
of 50,257 ids (256 bytes, 50,000 merges, `<|endoftext|>`) with the `tokenizers` library, on
generated text whose words follow a Zipf law over a vocabulary of `--words` pseudo-words built
from syllables (frequent words short, as in natural language), so that its merges and its
bytes per token are a natural language's (~4.3 bytes per token on the corpus, about GPT-2's on
English; Dolma's approximate figures below give ~3.7). It is cached in `--dir` and reused while
its settings are the same.

Then, in one run:

1. a Dolma-like corpus: `--files` gzip JSON lines files (`.json.gz`, as Dolma ships them) of
   `--docs-per-file` documents (`id`, `text`, `source`, `added`, `metadata`) of log-normal
   length (median ~1.5 KB, mean ~2.8 KB, a tail to tens of KB);
2. the reference: the bare tokenizer (`encode_batch_fast`, batches of the job's 1,024
   documents) over the same texts, in this process on one thread (TOKENIZERS_PARALLELISM=false:
   tokenizers 0.22 then encodes in the calling thread and starts no Rayon pool, which the
   thread's CPU time equalling the process's confirms; RAYON_RS_NUM_CPUS=1 and
   RAYON_NUM_THREADS=1 are honoured too, but keep one pool thread beside the caller) ->
   documents/s, MB/s of text per core (wall), MB per CPU second, and the corpus' bytes per
   token;
3. the job's own work on one file (the DoFn called in this process, no Beam), tokens and
   bytes, in MB per CPU second; with `--profile`, cProfile's top functions;
4. `tally manifest` (the CLI, a subprocess, as a user runs it) with that tokenizer on the
   runners of `--runners` (FnApiRunner multi_processing, a local Dask cluster; `--workers`
   each; their workers keep tokenizers' default threads), first over one document (the
   runner's fixed cost), then over the corpus; and without a tokenizer (the bytes basis) on the
   first: documents/s, MB/s, MB/s per core, CPU seconds of the process tree (and per worker),
   the ratio job MB/s / (reference MB/s per core x workers), the same ratio in CPU time (job
   MB per CPU s / reference MB per CPU s: a busy box moves it less), peak RSS of the driver, of the
   largest worker and of the whole tree. Every tokens run's hashes must equal the reference's
   token ids hashed one document at a time;
5. the same tokens job over the same documents in files of 4x the documents (`--files` / 4
   files): a compressed file is one element read whole by one worker, so this is where memory
   would grow with the corpus; its peak RSS should equal (4)'s;
6. an extrapolation to Dolma v1.6 at the job's measured MB/s per core.

The corpus and the manifests are removed at the end (`--keep` keeps them); the tokenizer stays.

    python -m bench.text_manifest_rate [--files 8] [--docs-per-file 5000] [--workers 2]
        [--runners multi_processing,dask] [--dir bench/out/text_manifest] [--keep] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tally.audit.core.hashing import content_hash  # noqa: E402
from tally.pipeline.corpus import open_corpus  # noqa: E402
from tally.pipeline.manifest import TEXT_BATCH, _WritePart  # noqa: E402
from tally.pipeline.text import TextHasher  # noqa: E402

# Dolma v1.6, approximately, as recalled from the Dolma paper (Soldaini et al., 2024) and
# OLMo's release notes: ~4.4 billion documents, ~3 trillion tokens, ~11 TB of UTF-8 text.
DOLMA_DOCS = 4.4e9
DOLMA_TOKENS = 3.0e12
DOLMA_BYTES = 11e12
SOURCES = ("common-crawl", "c4", "reddit", "stack", "pes2o", "wiki", "gutenberg")
WEIGHTS = (0.80, 0.08, 0.05, 0.04, 0.015, 0.01, 0.005)  # roughly Dolma's share by documents

ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v",
          "w", "y", "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr",
          "sh", "sl", "sp", "st", "str", "th", "tr", "wh", "qu", "sc")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y", "ie", "au")
CODAS = ("", "n", "r", "s", "t", "l", "d", "m", "ng", "st", "nd", "ck", "th", "x", "rt", "ll",
         "ss", "nt")
ACCENTS = str.maketrans("aeiou", "áéíöü")
SUFFIXES = (" ", ", ", ". ", ".\n\n")  # after a word: a space, a comma, a sentence, a paragraph
SUFFIX_P = (0.87, 0.06, 0.065, 0.005)


def _weights(items: tuple[str, ...], common: str, single: float, empty: float) -> np.ndarray:
    w = np.array([single * (2.5 if x in common else 1.0) if len(x) == 1 else 0.12
                  for x in items])
    w[0] = empty
    return w / w.sum()


def pseudo_words(n: int, seed: int = 0) -> list[str]:
    """`n` distinct pseudo-words by rank: syllables of English-like letter frequencies, the
    number of syllables growing with the rank (frequent words short: ~4.9 letters a word in
    running text, ~7.5 over the vocabulary, as English's), ~3% with an accented vowel."""
    rng = np.random.default_rng(seed)
    syllables = [o + v + c for o in ONSETS for v in VOWELS for c in CODAS]
    p = (_weights(ONSETS, "tnsrldmh", 1.0, 0.25)[:, None, None]
         * _weights(VOWELS, "eaio", 1.0, 0.12)[None, :, None]
         * _weights(CODAS, "nrstl", 0.4, 1.2)[None, None, :]).ravel()
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        m = 2 * (n - len(words)) + 1000
        k = 1 + rng.poisson(0.2 * np.log10(len(words) + np.arange(m) + 2))
        picks = rng.choice(len(syllables), size=int(k.sum()), p=p)
        accent = rng.random(m) < 0.03
        ends = np.cumsum(k)
        for j, (a, b) in enumerate(zip(ends - k, ends, strict=True)):
            w = "".join(syllables[i] for i in picks[a:b])
            if accent[j]:
                w = w[:-1] + w[-1].translate(ACCENTS)
            if w not in seen:
                seen.add(w)
                words.append(w)
                if len(words) == n:
                    break
    return words


class TextGen:
    """Running text over a pseudo-word vocabulary: words drawn by a Zipf law (p ~ 1/rank),
    commas, sentences (capitalised) and paragraphs."""

    def __init__(self, words: list[str]) -> None:
        cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1))
        self.cdf = cdf / cdf[-1]
        self.words = np.array(words, dtype=object)
        self.capitals = np.array([w.capitalize() for w in words], dtype=object)
        self.suffixes = np.array(SUFFIXES, dtype=object)

    def pieces(self, n: int, rng: np.random.Generator) -> list[str]:
        """2n strings: word, suffix, word, suffix, ..."""
        idx = np.searchsorted(self.cdf, rng.random(n))
        suf = rng.choice(len(SUFFIXES), size=n, p=SUFFIX_P)
        capital = np.empty(n, bool)
        capital[0], capital[1:] = True, suf[:-1] >= 2
        out = np.empty(2 * n, object)
        out[0::2] = np.where(capital, self.capitals[idx], self.words[idx])
        out[1::2] = self.suffixes[suf]
        return out.tolist()

    def text(self, n_bytes: int, rng: np.random.Generator) -> str:
        return "".join(self.pieces(max(1, n_bytes // 6), rng))  # ~6 bytes a word, suffix in

    def documents(self, n: int, rng: np.random.Generator) -> list[str]:
        """`n` documents of log-normal length: median 220 words (~1.5 KB), mean ~400."""
        words = np.clip(rng.lognormal(np.log(220), 1.1, n), 8, 40_000).astype(np.int64)
        pieces = self.pieces(int(words.sum()), rng)
        ends = 2 * np.cumsum(words)
        return ["".join(pieces[a:b]).rstrip() for a, b in zip(ends - 2 * words, ends,
                                                              strict=True)]


def tokenizer(root: Path, gen: TextGen, vocab_size: int, train_mb: float, tag: str) -> tuple[
        Path, float]:
    """The byte-level BPE tokenizer.json of these settings, trained (and cached under `root`)
    unless cached; (path, training seconds, 0 when cached)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = root / f"tokenizer-bpe{vocab_size}-{tag}-train{train_mb:g}MB.json"
    if path.exists():
        return path, 0.0
    rng = np.random.default_rng(1)
    text = gen.text(int(train_mb * 1e6), rng)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex too
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t0 = time.perf_counter()
    tok.train_from_iterator((text[i:i + 100_000] for i in range(0, len(text), 100_000)),
                            trainer=trainer)
    dt = time.perf_counter() - t0
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name)
    tok.save(str(tmp))
    os.replace(tmp, path)
    return path, dt


def write_corpus(root: Path, gen: TextGen, files: int, per_file: int, seed: int) -> list[Path]:
    """Dolma-like `.json.gz` files of `per_file` documents each."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    n = 0
    for f in range(files):
        texts = gen.documents(per_file, rng)
        src = rng.choice(len(SOURCES), size=per_file, p=WEIGHTS)
        lines = []
        for text, s in zip(texts, src, strict=True):
            lines.append(json.dumps({
                "id": f"bench-{n:010d}", "text": text, "source": SOURCES[s],
                "added": "2026-12-03T00:00:00.000Z", "created": "2024-01-01T00:00:00.000Z",
                "metadata": {"url": f"https://example.org/{n}", "length": len(text)}},
                ensure_ascii=False))
            n += 1
        path = root / f"part-{f:04d}.json.gz"
        # Level 1: the bench writes hundreds of MB; the reader's cost is the same at any level.
        path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=1))
        paths.append(path)
    return paths


def regroup(root: Path, paths: list[Path], k: int) -> list[Path]:
    """The same documents in the same order, `k` files' worth to a file."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(0, len(paths), k):
        data = b"".join(gzip.decompress(p.read_bytes()) for p in paths[i:i + k])
        out.append(root / f"part-{i // k:04d}.json.gz")
        out[-1].write_bytes(gzip.compress(data, compresslevel=1))
    return out


def texts_of(paths: list[Path]):
    """Each file's texts, in corpus order."""
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            yield [json.loads(line)["text"] for line in f]


def reference(tok_path: Path, paths: list[Path]) -> dict:
    """The bare tokenizer over the corpus' texts on one thread, timed over the encode calls
    only; the documents' token-id hashes (untimed) for the job's to equal."""
    from tokenizers import Tokenizer

    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by tokenizers at every batch call
    try:
        tok = Tokenizer.from_file(str(tok_path))
        wall = cpu = thread = 0.0
        docs = n_bytes = tokens = 0
        hashes = []
        for texts in texts_of(paths):
            n_bytes += sum(len(t.encode()) for t in texts)
            for a in range(0, len(texts), TEXT_BATCH):
                batch = texts[a:a + TEXT_BATCH]
                t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
                enc = tok.encode_batch_fast(batch, add_special_tokens=False)
                wall += time.perf_counter() - t0
                cpu += time.process_time() - c0
                thread += time.thread_time() - h0
                for e in enc:
                    ids = np.asarray(e.ids, np.int32)
                    tokens += len(ids)
                    hashes.append(content_hash(ids))
            docs += len(texts)
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    return {"docs": docs, "bytes": n_bytes, "tokens": tokens, "seconds": wall, "cpu_s": cpu,
            "thread_cpu_s": thread, "hashes": np.array(hashes, np.uint64)}


def element_work(tok_path: Path | None, path: Path, parts: Path,
                 profile: bool) -> tuple[float, str]:
    """Process CPU seconds of one element's work (a file read, tokenized, hashed and written
    as its part file: the job's DoFn, called here without Beam), and, when `profile`, the
    cProfile lines of the functions that took the most time."""
    import cProfile
    import io
    import pstats

    parts.mkdir(parents=True, exist_ok=True)
    shard = open_corpus([path.absolute()]).shards[0]
    fn = _WritePart(str(parts), TextHasher(tok_path) if tok_path else TextHasher(None))
    prof = cProfile.Profile() if profile else None
    c0 = time.process_time()
    if prof:
        prof.enable()
    (done,) = fn.process((0, shard, 0, None))
    if prof:
        prof.disable()
    cpu = time.process_time() - c0
    assert done[1] > 0, done
    shutil.rmtree(parts)
    text = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
        text = buf.getvalue()
    return cpu, text


def _hwm(pid: int | str) -> int:
    """VmHWM (peak RSS) of a process, bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


def run_manifest(cli_args: list[str]) -> dict:
    """`tally manifest CLI_ARGS` as a subprocess, as a user runs it: wall seconds; CPU seconds
    of the command and its workers (wait4's rusage, which counts the reaped workers, or the
    sum of what sampling saw, whichever is larger); each process' peak RSS (VmHWM read every
    0.1 s until it ends): the driver's and the largest worker's; the largest sum of the tree's
    RSS over the samples; CPU seconds of the driver and of each worker that did work."""
    import psutil

    root = Path(__file__).resolve().parent.parent
    peak: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tree_peak = 0
    # stderr to a file, not a pipe: nobody reads it while the command runs.
    with tempfile.TemporaryFile() as errors:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tally.audit.cli", "manifest", *cli_args,
                                 "-q"], cwd=root, stdout=subprocess.DEVNULL, stderr=errors)
        # The command supervises itself: its own process waits for the one that runs the job
        # (the driver), whose descendants are the workers.
        command, drivers = psutil.Process(proc.pid), set()
        while True:
            # wait4, not Popen.poll: its rusage holds the CPU time of the command's tree.
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            tree = 0
            with contextlib.suppress(psutil.Error):
                drivers.update(c.pid for c in command.children())
                for p in [command, *command.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        tree += p.memory_info().rss
                        cpu[p.pid] = sum(p.cpu_times()[:2])
                        peak[p.pid] = max(peak.get(p.pid, 0), _hwm(p.pid))
            tree_peak = max(tree_peak, tree)
            time.sleep(0.1)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            errors.seek(0)
            raise RuntimeError(f"tally manifest {' '.join(cli_args)}: exit {proc.returncode}\n"
                               + errors.read().decode(errors="replace"))
    workers = {pid for pid in peak if pid not in drivers and pid != proc.pid}
    return {"seconds": wall,
            "cpu_s": max(usage.ru_utime + usage.ru_stime, sum(cpu.values())),
            "driver_peak_rss": max((peak[p] for p in drivers), default=0),
            "worker_peak_rss": max((peak[p] for p in workers), default=0),
            "tree_peak_rss": tree_peak,
            "driver_cpu_s": sum(cpu.get(p, 0.0) for p in drivers),
            "worker_cpu_s": sorted((cpu[p] for p in workers if cpu[p] > 0.5), reverse=True)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--docs-per-file", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runners", default="multi_processing,dask",
                    help="comma-separated: multi_processing, dask")
    ap.add_argument("--vocab-size", type=int, default=50_257,
                    help="the BPE's ids (default GPT-2's 50,257)")
    ap.add_argument("--words", type=int, default=1_000_000, help="pseudo-word vocabulary")
    ap.add_argument("--train-mb", type=float, default=20.0,
                    help="MB of generated text the tokenizer is trained on")
    ap.add_argument("--dir", default="bench/out/text_manifest",
                    help="where the tokenizer is cached and the corpus written")
    ap.add_argument("--keep", action="store_true", help="keep the corpus and the manifests")
    ap.add_argument("--no-fixed", action="store_true",
                    help="skip the one-document jobs (the runners' fixed cost)")
    ap.add_argument("--profile", action="store_true",
                    help="print cProfile's top functions of one file's work")
    args = ap.parse_args(argv)
    if args.files % 4:
        ap.error("--files must be a multiple of 4 (the memory run uses files / 4)")
    logging.getLogger().setLevel(logging.ERROR)
    root = Path(args.dir)
    work = root / f"run-{os.getpid()}"
    res: dict = {"runs": {}}
    try:
        gen = TextGen(pseudo_words(args.words))
        tok, train_s = tokenizer(root, gen, args.vocab_size, args.train_mb, f"w{args.words}")
        res.update(tokenizer=str(tok), train_s=train_s)
        print(f"tokenizer: byte-level BPE, {args.vocab_size:,} ids, "
              + (f"trained on {args.train_mb:g} MB in {train_s:.1f} s" if train_s else
                 f"cached ({tok})"))
        t0 = time.perf_counter()
        paths = write_corpus(work / "corpus", gen, args.files, args.docs_per_file, seed=2)
        gz = sum(p.stat().st_size for p in paths)
        gen_s = time.perf_counter() - t0

        ref = reference(tok, paths)
        docs, size = ref["docs"], ref["bytes"]
        per_core = size / ref["seconds"]
        res.update(docs=docs, bytes=size, tokens=ref["tokens"],
                   bytes_per_token=size / ref["tokens"], reference_s=ref["seconds"],
                   reference_mb_s=per_core / 1e6, reference_docs_s=docs / ref["seconds"],
                   reference_mb_per_cpu_s=size / 1e6 / ref["thread_cpu_s"],
                   reference_one_thread=ref["thread_cpu_s"] / max(ref["cpu_s"], 1e-9))
        print(f"corpus: {args.files} files x {args.docs_per_file:,} documents = {docs:,} "
              f"documents, {size / 1e6:,.1f} MB of text (mean {size / docs / 1e3:.1f} KB), "
              f"{gz / 1e6:,.1f} MB gzip, written in {gen_s:.0f} s; {ref['tokens']:,} tokens, "
              f"{size / ref['tokens']:.2f} bytes per token")
        print(f"reference, bare tokenizer (encode_batch_fast) on one thread: {ref['seconds']:.1f}"
              f" s, {docs / ref['seconds']:,.0f} documents/s, {per_core / 1e6:.2f} MB/s per core"
              f", {res['reference_mb_per_cpu_s']:.2f} MB per CPU s (the thread's CPU time / the "
              f"process': {res['reference_one_thread']:.2f})")

        # The job's own work per element, in this process without Beam: one file, tokens and
        # bytes (process CPU: the tokenizer's Rayon threads count).
        one = paths[0]
        one_bytes = sum(len(t.encode()) for t in next(texts_of([one])))
        for basis, tk in (("tokens", tok), ("bytes", None)):
            cpu, prof = element_work(tk, one, work / "parts", args.profile)
            res[f"work_{basis}_mb_per_cpu_s"] = one_bytes / 1e6 / cpu
            print(f"the job's work on one file, {basis}, in this process without Beam: "
                  f"{one_bytes / 1e6 / cpu:.2f} MB per CPU s")
            if prof:
                print(prof)

        specs = {"multi_processing": ["--runner", "direct", "--mode", "multi_processing",
                                      "--workers", str(args.workers)],
                 "dask": ["--runner", "dask", "--workers", str(args.workers)]}
        names = {"multi_processing": f"FnApiRunner multi_processing, {args.workers} workers",
                 "dask": f"Dask local cluster, {args.workers} workers"}
        keys = args.runners.split(",")
        jobs = [(k, names[k] + ", tokens", specs[k], tok, paths) for k in keys]
        jobs.append(("bytes", names[keys[0]] + ", bytes basis (no tokenizer)", specs[keys[0]],
                     None, paths))
        big = regroup(work / "corpus4x", paths, 4)
        jobs.append(("files4x", names[keys[0]] + f", tokens, {args.files // 4} files of "
                     f"{4 * args.docs_per_file:,} documents", specs[keys[0]], tok, big))
        tiny = work / "tiny" / "one.jsonl"
        tiny.parent.mkdir()
        tiny.write_text(json.dumps({"id": "x", "text": "One document.", "source": "x"}) + "\n")
        for k in [] if args.no_fixed else keys:
            res[f"fixed_s_{k}"] = run_manifest([str(tiny), "-o", str(work / "tiny.parquet"),
                                                "--tokenizer", str(tok), *specs[k]])["seconds"]
            print(f"{names[k]}: the same job over one document {res[f'fixed_s_{k}']:.1f} s "
                  "(the runner's fixed cost)")
        for key, name, spec, tk, corpus in jobs:
            out = work / f"{key}.parquet"
            use = run_manifest([*map(str, corpus), "-o", str(out), *spec,
                                *(["--tokenizer", str(tk)] if tk else [])])
            dt = use["seconds"]
            assert pq.read_metadata(out).num_rows == docs, key
            if tk is not None:
                got = pq.read_table(out, columns=["content_hash"])["content_hash"].to_numpy()
                assert np.array_equal(got, ref["hashes"]), key  # the loop's hashes
            mb_s = size / 1e6 / dt
            run = {**use, "docs_s": docs / dt, "mb_s": mb_s,
                   "mb_s_per_core": mb_s / args.workers,
                   "ratio": mb_s / (per_core / 1e6 * args.workers),
                   "mb_per_cpu_s": size / 1e6 / use["cpu_s"]}
            # The same ratio in CPU time, which a busy machine moves less than wall time.
            run["cpu_ratio"] = run["mb_per_cpu_s"] / res["reference_mb_per_cpu_s"]
            res["runs"][key] = run
            print(f"{name}: {dt:.1f} s, {docs / dt:,.0f} documents/s, {mb_s:.2f} MB/s, "
                  f"{mb_s / args.workers:.2f} MB/s per core, ratio {run['ratio']:.2f} (in CPU "
                  f"time {run['cpu_ratio']:.2f}); "
                  f"{use['cpu_s']:.0f} CPU s ({run['mb_per_cpu_s']:.2f} MB per CPU s; driver "
                  f"{use['driver_cpu_s']:.0f}, workers "
                  f"{', '.join(f'{c:.0f}' for c in use['worker_cpu_s'])}); peak RSS driver "
                  f"{use['driver_peak_rss'] / 2**20:,.0f} MiB, largest worker "
                  f"{use['worker_peak_rss'] / 2**20:,.0f} MiB, whole tree "
                  f"{use['tree_peak_rss'] / 2**20:,.0f} MiB")
            out.unlink()
        res["extrapolation"] = extrapolate(res, keys[0])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return res


def extrapolate(res: dict, key: str) -> dict:
    """Core-hours and wall time of a Dolma-sized corpus at three rates per core: the job's end to
    end (this run's start-up included), the job's own work per element (what each added core
    adds once the runner has started), and the bare tokenizer's (the bound). Storage and the
    driver's join (one core, streaming) are assumed to keep up."""
    rates = (("the job end to end", res["runs"][key]["mb_s_per_core"]),
             ("the job's work per element", res["work_tokens_mb_per_cpu_s"]),
             ("the bare tokenizer", res["reference_mb_s"]))
    out = {}
    print(f"Dolma v1.6 (approximately {DOLMA_DOCS / 1e9:.1f}B documents, "
          f"{DOLMA_TOKENS / 1e12:.0f}T tokens, {DOLMA_BYTES / 1e12:.0f} TB of text):")
    for what, mb_s in rates:
        hours = DOLMA_BYTES / (mb_s * 1e6) / 3600
        out[what] = {"mb_s_per_core": mb_s, "core_hours": hours, "hours_64": hours / 64,
                     "hours_512": hours / 512}
        print(f"  at {what}'s {mb_s:.2f} MB/s per core: {hours:,.0f} core-hours; "
              f"{hours / 64:,.1f} h on 64 cores, {hours / 512:,.1f} h on 512")
    return out


if __name__ == "__main__":
    main()
