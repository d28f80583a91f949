"""The standard-library corpus (megatron_eopt/training/corpus.py) on a small fake library: which
files it takes and in what order, the bytes the indexed dataset holds, and the cache."""

import hashlib
import threading
import json
import pathlib

from megatron_eopt.training import corpus

EOD = 256  # ByteLevelTokenizer's end-of-document id


def _fake_library(root: pathlib.Path) -> dict[str, str]:
    sources = {"a.py": "import os\n", "pkg/b.py": "x = 'é'\n", "pkg/c.py": "def f():\n    return 1\n",
               "z.py": "print('z')\n" * 5, "test/t.py": "assert 0\n", "pkg/tests/u.py": "assert 1\n",
               "idlelib/idle_test/v.py": "pass\n", "notes.txt": "not python\n", "empty.py": ""}
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return sources


def _order(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: hashlib.sha256(name.encode()).hexdigest())


def test_stdlib_files_leave_out_tests_and_follow_the_hash_order(tmp_path: pathlib.Path) -> None:
    sources = _fake_library(tmp_path)
    taken = [p.relative_to(tmp_path).as_posix() for p in corpus.stdlib_files(tmp_path, max_bytes=10**6)]
    assert taken == _order(["a.py", "pkg/b.py", "pkg/c.py", "z.py"])
    # A budget that fits only some files: each file is taken in order if it still fits.
    budget = len(sources["a.py"]) + len(sources["pkg/c.py"].encode())
    small = [p.relative_to(tmp_path).as_posix() for p in corpus.stdlib_files(tmp_path, max_bytes=budget)]
    expected, used = [], 0
    for name in _order(["a.py", "pkg/b.py", "pkg/c.py", "z.py"]):
        size = len(sources[name].encode())
        if used + size <= budget:
            expected.append(name)
            used += size
    assert small == expected and sum(len(sources[n].encode()) for n in small) <= budget


def test_prepare_writes_each_file_as_bytes_then_eod_and_reuses_the_cache(tmp_path: pathlib.Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    library = tmp_path / "lib"
    library.mkdir()
    sources = _fake_library(library)
    built = corpus.prepare_stdlib_corpus(str(tmp_path / "cache"), 10**6, root=str(library), verbose=False)
    names = _order(["a.py", "pkg/b.py", "pkg/c.py", "z.py"])
    assert built.documents == 4 and built.bytes == sum(len(sources[n].encode()) for n in names)
    dataset = IndexedDataset(built.prefix)
    assert [list(dataset[i]) for i in range(len(dataset))] == [list(sources[n].encode()) + [EOD] for n in names]
    manifest = json.loads((pathlib.Path(built.prefix).parent / "manifest.json").read_text())
    assert manifest["files"] == names
    assert built.trainer_flags()[:4] == ["--data-path", built.prefix, "--split", "95,5,0"]

    bin_file = pathlib.Path(built.prefix + ".bin")
    stamp = bin_file.stat().st_mtime_ns
    (library / "new.py").write_text("y = 2\n")  # would change the corpus if it were rebuilt
    again = corpus.prepare_stdlib_corpus(str(tmp_path / "cache"), 10**6, root=str(library), verbose=False)
    assert again == built and bin_file.stat().st_mtime_ns == stamp


def test_builds_at_once_show_no_half_written_corpus_and_leave_one(tmp_path: pathlib.Path) -> None:
    """Two jobs that start together on a fresh machine: while one build is half-written nothing is
    at the cache's path; both then read one complete corpus, and no build folder is left."""
    folder, halfway, finish = tmp_path / "stdlib-x", threading.Event(), threading.Event()

    def build(into: pathlib.Path, wait: bool) -> None:
        (into / "manifest.json").write_text(json.dumps({"files": ["a.py"], "bytes": 1}))
        if wait:
            halfway.set()
            assert finish.wait(30)
        for ext in (".bin", ".idx"):
            (into / f"stdlib_text_document{ext}").write_bytes(b"x")

    results = {}
    slow = threading.Thread(target=lambda: results.setdefault("slow", corpus._built_once(
        folder, "stdlib", lambda into: build(into, wait=True))))
    slow.start()
    assert halfway.wait(30)
    assert not folder.exists()  # the half-written build is not where readers look
    results["fast"] = corpus._built_once(folder, "stdlib", lambda into: build(into, wait=False))
    finish.set()
    slow.join(30)
    assert results["slow"] == results["fast"] == {"files": ["a.py"], "bytes": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["stdlib-x"]
