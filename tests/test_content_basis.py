"""The run's content basis against the manifest's: a loop that tokenizes text on the fly says how
it hashes (LedgerWriter(content_basis=...), the spool's `tally.content_basis`), and reconcile,
from the spool and from a ledger, compares it with the manifest's: agreeing bases PASS with the
basis named in report.json and report.html; a run that added EOS is one manifest_mismatch
naming `eos_id`, not a flood of hash mismatches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tally.audit.hook.writer import LedgerWriter
from tally.pipeline.manifest_file import write_manifest_table
from tally.pipeline.text import TextHasher
from tests.support.cli import tally
from tests.support.text_corpus import documents, loop_hashes, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DOCS, HELDOUT, BATCH, STEPS = 48, 8, 4, 10  # 40 train records, one epoch


def text_manifest(path: Path, docs: list[dict], hasher: TextHasher, tokenizer: Path | None
                  ) -> Path:
    """The manifest of `docs` (the first DOCS - HELDOUT train) under the hasher's basis, with
    hashes from the independent reference (tests.support.text_corpus), not from
    tally.pipeline.text."""
    b = hasher.basis
    settings = {} if tokenizer is None else {
        "bos_id": b.bos_id, "eos_id": b.eos_id, "special_tokens": b.special_tokens,
        "max_tokens": b.max_tokens}
    hashes, lengths = loop_hashes([d["text"] for d in docs], tokenizer, **settings)
    n = len(docs)
    table = pa.table({
        "record_key": np.arange(n, dtype=np.int64),
        "content_hash": pa.array(hashes, pa.uint64()),
        "n_tokens": pa.array(lengths, pa.int32()),
        "domain": [d["source"] for d in docs],
        "split": ["train"] * (n - HELDOUT) + ["heldout"] * HELDOUT,
        "source": ["docs.jsonl"] * n,
        "source_index": np.arange(n, dtype=np.int64),
        "doc_id": [d["id"] for d in docs],  # kept where the manifest has the column
    })
    return write_manifest_table(table, path, corpus="docs.jsonl", **b.metadata())


def run_loop(spool: Path, run_id: str, docs: list[dict], hasher: TextHasher, *,
             say_basis: bool = True, order: np.ndarray | None = None) -> None:
    """A loop that tokenizes each batch's text on the fly and hands the writer the padded token
    batch (one document a row): the train records in `order` (default: one pass in order),
    BATCH a step."""
    train = docs[:DOCS - HELDOUT]
    order = np.arange(STEPS * BATCH) if order is None else np.asarray(order)
    with LedgerWriter(spool, run_id, flush_every=4,
                      content_basis=hasher.basis if say_basis else None) as w:
        for step in range(len(order) // BATCH):
            keys = order[step * BATCH:(step + 1) * BATCH]
            flat, offsets = hasher.token_ids([train[k]["text"] for k in keys])
            lengths = np.diff(offsets)
            tokens = np.zeros((BATCH, int(lengths.max())), np.int32)
            seg = np.zeros_like(tokens)
            for r in range(BATCH):
                tokens[r, :lengths[r]] = flat[offsets[r]:offsets[r + 1]]
                seg[r, :lengths[r]] = 1
            w.write_batch(step, {"tokens": tokens, "tokens_segment_ids": seg, "key": keys})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("basis")
    tok = train_tokenizer(tmp / "tok")
    docs = documents(DOCS, seed=3)
    plain = TextHasher(tok)
    manifest = text_manifest(tmp / "m.parquet", docs, plain, tok)
    spool = tmp / "spool"
    run_loop(spool, "same", docs, plain)
    run_loop(spool, "eos", docs, TextHasher(tok, eos_id=1))
    run_loop(spool, "quiet", docs, plain, say_basis=False)
    return tmp, tok, docs, manifest, spool


def test_writer_records_the_basis_in_every_file(corpus):
    from tally.audit.hook import spool as sp

    tmp, tok, _, _, spool = corpus
    files = sorted((spool / "eos").rglob("*.parquet"))
    assert files
    for f in files:
        md = pq.read_metadata(f).metadata
        basis = json.loads(md[b"tally.content_basis"])
        assert basis["kind"] == "tokens" and basis["eos_id"] == 1
        assert basis["tokenizer"] == TextHasher(tok).basis.tokenizer
    # A loop that did not say writes the key empty: unknown, and the file still checks.
    quiet = sorted((spool / "quiet").rglob("seg-*.parquet"))[0]
    assert pq.read_metadata(quiet).metadata[b"tally.content_basis"] == b""
    [(f, _)] = [x for x in sp.scan(spool) if not isinstance(x[0], sp.Stray)
                and x[0].path == quiet]
    _, info = sp.read_checked(f)
    assert info["content_basis"] is None
    with pytest.raises(ValueError, match="content_basis"):
        LedgerWriter(tmp / "other", "x", content_basis=42)


@pytest.mark.slow
def test_reconcile_passes_when_the_bases_agree_and_says_the_basis(corpus, tmp_path):
    tmp, tok, _, manifest, spool = corpus
    out = tmp_path / "same"
    r = tally("reconcile", "--spool", str(spool), "--run", "same", "--manifest", str(manifest),
              "-o", str(out), "--runner", "direct", "--json", "-q")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "PASS", rep["findings"]
    integ = rep["integrity"]
    assert integ["hash_mismatches"] == 0 and integ["hash_checked"] == STEPS * BATCH
    basis = integ["content_basis"]
    assert basis["kind"] == "tokens" and basis["tokenizer_name"] == str(tok)
    assert basis["description"].startswith(f"token ids of tokenizer {tok}")
    assert rep["content_basis"]["differences"] == []
    assert [b["kind"] for b in rep["content_basis"]["run"]] == ["tokens"]
    html = (out / "report.html").read_text()
    assert 'data-fact="content basis">content hashes over token ids of tokenizer' in html
    # A run that did not say its basis: unknown, never a finding; same figures.
    quiet = tally("reconcile", "--spool", str(spool), "--run", "quiet", "--manifest",
                  str(manifest), "-o", str(tmp_path / "quiet"), "--runner", "direct", "-q")
    assert quiet.returncode == 0, quiet.stderr
    rq = json.loads((tmp_path / "quiet" / "report.json").read_text())
    assert rq["verdict"] == "PASS" and rq["content_basis"] == {"run": [], "differences": []}


@pytest.mark.slow
def test_a_run_that_added_eos_is_one_manifest_mismatch(corpus, tmp_path):
    _, _, _, manifest, spool = corpus
    led = tmp_path / "l.duckdb"
    r = tally("ingest", str(spool), "--ledger", str(led), "-q")
    assert r.returncode == 0, r.stderr
    for kind, src in (("spool", spool), ("ledger", led)):
        out = tmp_path / kind
        r = tally("reconcile", f"--{kind}", str(src), "--run", "eos", "--manifest",
                  str(manifest), "-o", str(out), "--runner", "direct", "-q")
        assert "Traceback" not in r.stderr and r.returncode == 0, (kind, r.stderr)
        rep = json.loads((out / "report.json").read_text())
        codes = [f["code"] for f in rep["findings"] if f["severity"] == "FAIL"]
        assert codes == ["manifest_mismatch"], (kind, rep["findings"])
        [f] = [f for f in rep["findings"] if f["code"] == "manifest_mismatch"]
        # Every record is one token longer (EOS appended to each): none checkable, said
        # once, with the count, and no hash_mismatch besides.
        integ = rep["integrity"]
        assert (integ["hash_checked"], integ["hash_unverifiable"]) == (0, STEPS * BATCH)
        assert "eos_id 1, not None" in f["message"], f["message"]
        assert (f"because of it, {STEPS * BATCH} segments are of another length than the "
                "manifest's record and could not be checked") in f["message"], f["message"]
        assert f["numbers"]["unverifiable"] == STEPS * BATCH
        assert rep["verdict"] == "FAIL" and rep["content_basis"]["run"][0]["eos_id"] == 1
    # The ledger keeps each run's basis: the agreeing run passes from it too.
    r = tally("reconcile", "--ledger", str(led), "--run", "same", "--manifest", str(manifest),
              "-o", str(tmp_path / "same"), "--runner", "direct", "-q")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "same" / "report.json").read_text())["verdict"] == "PASS"


@pytest.mark.slow
def test_a_ledger_without_the_column_still_opens(corpus, tmp_path):
    """A ledger made before runs kept a content basis: read-only it reads as unknown; the first
    writable opening adds the column."""
    import duckdb

    from tally.audit.ledger.database import Ledger

    _, _, _, manifest, spool = corpus
    led = tmp_path / "old.duckdb"
    assert tally("ingest", str(spool), "--ledger", str(led), "-q").returncode == 0
    con = duckdb.connect(str(led))
    con.execute("ALTER TABLE runs DROP COLUMN content_basis")
    con.close()
    with Ledger(led, read_only=True) as ledger:
        assert ledger.run_content_basis(1) is None
    r = tally("reconcile", "--ledger", str(led), "--run", "eos", "--manifest", str(manifest),
              "-o", str(tmp_path / "r"), "--runner", "direct", "-q")
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    # Unknown basis, yet every record start is one token longer than the manifest's whole
    # record, which no loop reading these records makes: one WARN by mechanism (it used to
    # pass silently, every segment counted unverifiable).
    assert rep["content_basis"] == {"run": [], "differences": []}
    integ = rep["integrity"]
    assert integ["hash_unverifiable"] == integ["hash_overlong"] == STEPS * BATCH
    said = [f for f in rep["findings"] if f["severity"] != "INFO"]
    assert [(f["severity"], f["code"]) for f in said] == [("WARN", "records_longer")], said
    assert said[0]["numbers"]["overlong"] == STEPS * BATCH
    assert "longer than the manifest's whole record" in said[0]["message"]
    with Ledger(led) as ledger:  # writable: migrated
        assert "content_basis" in ledger._columns("runs")


@pytest.mark.slow
def test_diff_names_the_run_whose_basis_differs(corpus, tmp_path):
    _, _, _, manifest, spool = corpus
    out = tmp_path / "diff"
    r = tally("diff", "--manifest", str(manifest), "-o", str(out), "--a", f"{spool}:same",
              "--b", f"{spool}:eos", "--runner", "direct", "-q")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    d = json.loads((out / "diff.json").read_text())
    [f] = [f for f in d["findings"] if f["code"] == "manifest_mismatch"]
    assert f["numbers"]["run"] == "b" and "eos_id 1, not None" in f["message"]
    assert d["a"]["content_basis_differences"] == []


@pytest.mark.slow
def test_grain_attach_passes_the_basis_to_its_writer(corpus, tmp_path):
    """`audited(loader, spool, run_id, content_basis=...)`: the writer it makes says it; with
    hashes from a manifest, the manifest's basis by default."""
    import glob

    from tally.pipeline.grain_attach import audited
    from tests.test_grain_attach import SAMPLERS, loader

    _, tok, _, manifest, _ = corpus
    basis = TextHasher(tok, bos_id=0).basis
    for run_id, options, want in (("given", {"content_basis": basis}, basis.to_json()),
                                  ("from-manifest", {"hashes": manifest},
                                   pq.read_metadata(manifest).metadata[
                                       b"tally.content_basis"].decode())):
        au = audited(loader(SAMPLERS["index_plain_3_epochs"](), host=0, hosts=1), tmp_path, run_id,
                     fsync=False, **options)
        it = iter(au)
        next(it)
        au.writer.close()
        [f] = glob.glob(f"{tmp_path}/{run_id}/attempt=0/host=0/seg-*")
        assert pq.read_metadata(f).metadata[b"tally.content_basis"].decode() == want


def test_the_ledger_quarantines_a_file_of_another_basis(corpus, tmp_path):
    from tally.audit.ledger.database import Ledger

    _, tok, docs, _, _ = corpus
    spool = tmp_path / "spool"
    for host, hasher in enumerate((TextHasher(tok), TextHasher(tok, eos_id=1))):
        flat, offsets = hasher.token_ids([docs[host]["text"]])
        with LedgerWriter(spool, "mixed", host=host, host_count=2,
                          content_basis=hasher.basis) as w:
            w.write_batch(0, {"tokens": flat[None, :], "key": np.array([host])})
    led = tmp_path / "l.duckdb"
    r = tally("ingest", str(spool), "--ledger", str(led), "-q")
    assert "Traceback" not in r.stderr, r.stderr
    with Ledger(led, read_only=True) as ledger:
        [q] = ledger.query("SELECT path, reason FROM quarantine")
        assert "host=1" in q["path"] and q["reason"].startswith(
            "content basis differs from the run's (eos_id 1, not None)"), q
        [(run,)] = ledger.con.execute("SELECT run FROM runs WHERE run_id = 'mixed'").fetchall()
        assert json.loads(ledger.run_content_basis(run))["eos_id"] is None
