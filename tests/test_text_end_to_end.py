"""One end-to-end run per text-corpus format: the corpus written by its real library, its
manifest built by the manifest job with the run's tokenizer, a two-host loop that tokenizes the
documents on the fly (with the `tokenizers` library directly, not tally.pipeline.text) and hashes
what
it trains on, then reconcile: PASS, every record start's hash checked and equal, the basis the
loop declared agreeing with the manifest's."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.hook.writer import LedgerWriter
from tally.audit.reconcile import reconcile
from tally.pipeline.manifest import build_manifest
from tally.pipeline.runners import RunnerSpec
from tally.pipeline.text import TextHasher
from tests.support.text_corpus import documents, loop_token_ids, train_tokenizer
from tests.test_corpus_formats import _example, _write_examples, _write_mds

# Text corpora through the manifest job, the loop and reconcile, end to end.
pytestmark = pytest.mark.slow

HOSTS, BATCH, EOS = 2, 3, 1


def _jsonl(root: Path, docs: list[dict]) -> tuple[Path, int]:
    root.mkdir()
    # Written out of name order; the corpus order is by name: part-0 first.
    for name, part in (("part-1.jsonl.gz", docs[20:]), ("part-0.jsonl.gz", docs[:20])):
        (root / name).write_bytes(gzip.compress(
            "".join(json.dumps(d) + "\n" for d in part).encode()))
    return root, len(docs)


def _parquet(root: Path, docs: list[dict]) -> tuple[Path, int]:
    root.mkdir()
    pq.write_table(pa.Table.from_pylist(docs), root / "train-00000.parquet", row_group_size=7)
    return root, len(docs)


def _hf(root: Path, docs: list[dict]) -> tuple[Path, int]:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(docs[:30]),
                          "validation": datasets.Dataset.from_list(docs[30:])}
                         ).save_to_disk(str(root), num_shards={"train": 2, "validation": 1})
    return root, 30


def _tf_example(root: Path, docs: list[dict]) -> tuple[Path, int]:
    root.mkdir()
    for name, part in (("train-00000.array_record", docs[:16]),
                       ("train-00001.array_record", docs[16:30]),
                       ("heldout-00000.array_record", docs[30:])):
        _write_examples(root / name, [_example(
            {"text": d["text"], "id": d["id"], "source": d["source"]}) for d in part])
    return root, 30


def _mds(root: Path, docs: list[dict]) -> tuple[Path, int]:
    _write_mds(root, {"id": "str", "text": "str", "source": "str"}, docs,
               compression="zstd", size_limit=2048)
    return root, len(docs)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("write", [_jsonl, _parquet, _hf, _tf_example, _mds],
                         ids=["jsonl", "parquet_text", "hf_arrow", "tf_example", "mds"])
def test_text_corpus_through_manifest_loop_and_reconcile(write, tokenizer, tmp_path):
    docs = documents(36, seed=21)
    corpus, n_train = write(tmp_path / "corpus", docs)
    manifest = tmp_path / "manifest.parquet"
    summary = build_manifest(corpus, manifest, runner=RunnerSpec(), tokenizer=tokenizer,
                             eos_id=EOS)
    assert summary.records == len(docs) and summary.train_records == n_train
    assert pq.read_table(manifest, columns=["doc_id"])["doc_id"].to_pylist() == [
        d["id"] for d in docs]

    # The loop: train records in a seeded permutation, dealt to the hosts batch by batch; each
    # row is one document tokenized on the fly, EOS appended, padded.
    basis = TextHasher(tokenizer, eos_id=EOS).basis
    order = np.random.default_rng(0).permutation(n_train)
    per_step = HOSTS * BATCH
    steps = n_train // per_step
    texts = [d["text"] for d in docs[:n_train]]
    for h in range(HOSTS):
        with LedgerWriter(tmp_path / "spool", "text-run", host=h, host_count=HOSTS,
                          records_per_epoch=n_train, content_basis=basis, fsync=False) as w:
            for step in range(steps):
                keys = order[step * per_step + h * BATCH: step * per_step + (h + 1) * BATCH]
                ids = loop_token_ids([texts[k] for k in keys], tokenizer, eos_id=EOS)
                width = max(len(x) for x in ids)
                tokens, seg = np.zeros((BATCH, width), np.int32), np.zeros((BATCH, width),
                                                                           np.int32)
                for r, x in enumerate(ids):
                    tokens[r, :len(x)], seg[r, :len(x)] = x, 1
                w.write_batch(step, {"tokens": tokens, "tokens_segment_ids": seg,
                                     "key": keys.astype(np.int64)})
            w.finish()

    rep = reconcile(run_id="text-run", manifest=manifest, out=tmp_path / "report",
                    spool=tmp_path / "spool")
    assert rep["verdict"] == "PASS", rep["findings"]
    integ = rep["integrity"]
    assert integ["hash_checked"] == steps * per_step == n_train
    assert integ["hash_mismatches"] == integ["hash_unverifiable"] == 0
    assert rep["content_basis"]["differences"] == []
    assert integ["content_basis"]["kind"] == "tokens"
    assert rep["coverage"]["never_seen_fraction"] == 0.0
