"""Public datasets by name: every known dataset imports from ../shared/data
with its checksums, none is tracked in the repository, fetch is exercised
against an HTTP server on loopback (each failure one line, nothing
half-installed), a file altered after import is caught, a user's own trace
or profile registers under a name, and derived tables are cached by the
source's checksum."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from testbed.data import DataError, MissingDataset, dataset_dir
from testbed.data.cli import data_main
from testbed.data.fetch import fetch_dataset, fetch_manifest
from testbed.data.importer import import_dataset
from testbed.data.manifest import DataFile, Manifest, known_manifest, known_names
from testbed.sim.operator_table import tables_dir

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SHARED_COPIES = {"azure-code-2023": SHARED_DATA, "vidur-profiles": SHARED_DATA / "vidur-profiles",
                 "blis-h100": SHARED_DATA / "blis-h100"}


def entries(root: Path) -> list[str]:
    """Everything in a data directory, hidden staging directories included."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


# ---- the known datasets ---------------------------------------------------------

def test_the_known_datasets_are_these_three():
    assert known_names() == ["azure-code-2023", "blis-h100", "vidur-profiles"]


@pytest.mark.parametrize("name", ["azure-code-2023", "blis-h100", "vidur-profiles"])
def test_import_from_shared_installs_every_file_with_its_layout(tmp_path, name):
    manifest = known_manifest(name)
    where = import_dataset(name, SHARED_COPIES[name], data_dir=tmp_path)
    assert where == tmp_path / name == dataset_dir(name, "a test", data_dir=tmp_path)
    installed = sorted(p.relative_to(where).as_posix() for p in where.rglob("*") if p.is_file())
    assert installed == sorted([".manifest.json"] + [f.path for f in manifest.files])
    for f in manifest.files:
        assert (where / f.path).read_bytes() == (SHARED_COPIES[name] / f.path).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [name]           # no staging left


def test_the_session_data_directory_holds_every_known_dataset(data_dir):
    assert os.environ["TESTBED_DATA"] == str(data_dir)
    assert (dataset_dir("vidur-profiles", "hardware=h100-sxm") / "cpu_overheads" / "a100.csv").is_file()
    assert (dataset_dir("azure-code-2023", "workload=azure_code") / "AzureLLMInferenceTrace_code.csv").is_file()
    assert (dataset_dir("blis-h100", "a test") / "kernels" / "gemm" / "h100" / "data.csv").is_file()


def test_every_file_says_how_it_is_obtained_and_the_manifest_names_its_licence():
    for name in known_names():
        m = known_manifest(name)
        assert m.licence and m.citation and m.source and m.files
        for f in m.files:
            assert len(f.sha256) == 64 and f.size > 0
            assert (f.url or "").startswith("https://") or f.obtained, (name, f.path)
    blis = {f.path: f for f in known_manifest("blis-h100").files}
    assert blis["vllm-0.15-trainval.csv"].url is None and "assembled" in blis["vllm-0.15-trainval.csv"].obtained
    gz = blis["vllm-0.11-runs/jan21-llama7b-train-1/traces.json.gz"]
    assert gz.url is None and "gzip -9n" in gz.obtained


def test_no_tracked_file_is_a_dataset_file():
    known = {f.sha256: (name, f.path) for name in known_names() for f in known_manifest(name).files}
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    copies = []
    for rel in filter(None, tracked.decode().split("\0")):
        path = REPO / rel
        if path.is_file() and not path.is_symlink():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest in known:
                copies.append((rel, known[digest]))
    assert copies == []
    assert not (REPO / "conf" / "workload" / "traces").exists()
    assert not (REPO / "testbed" / "sim" / "vidur_tables").exists()


# ---- missing, altered ----------------------------------------------------------

def test_a_missing_dataset_is_one_line_naming_the_preset_and_both_commands(tmp_path):
    with pytest.raises(MissingDataset) as e:
        dataset_dir("vidur-profiles", "hardware=h100-sxm", data_dir=tmp_path)
    assert str(e.value) == (
        f"hardware=h100-sxm needs the dataset 'vidur-profiles', not in the data directory {tmp_path} "
        "(data.dir or $TESTBED_DATA, default ~/.cache/pd-testbed); bring it with `testbed data fetch vidur-profiles` or, "
        "from a local copy, `testbed data import vidur-profiles DIR`")


def run_cli(args: list[str], data: Path, cwd: Path) -> tuple[int, list[str]]:
    env = {**os.environ, "TESTBED_DATA": str(data), "WANDB_MODE": "disabled"}
    p = subprocess.run([sys.executable, "-m", "testbed.cli", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stderr.strip().splitlines()


def test_a_run_without_its_dataset_stops_at_start_up_in_one_line(tmp_path):
    code, err = run_cli(["run", "runtime=sim", "hardware=h100-sxm", "workload.num_requests=2",
                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "empty", tmp_path)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: hardware=h100-sxm needs the dataset "
                                                               "'vidur-profiles'"), err
    assert not (tmp_path / "run" / "requests.jsonl").exists()


def test_the_main_job_needs_no_dataset(tmp_path):
    """`testbed run` with its defaults (the tiny model on the CPU preset),
    here on the simulator, from an empty data directory."""
    code, err = run_cli(["run", "runtime=sim", "workload.num_requests=3", f"hydra.run.dir={tmp_path / 'run'}"],
                        tmp_path / "empty", tmp_path)
    assert code == 0, err
    assert (tmp_path / "run" / "summary.json").is_file() and not (tmp_path / "empty").exists()


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_a_file_damaged_after_import_is_named_in_one_line(tmp_path, damage):
    import_dataset("azure-code-2023", SHARED_DATA, data_dir=tmp_path / "data")
    path = tmp_path / "data" / "azure-code-2023" / "AzureLLMInferenceTrace_code.csv"
    body = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(body[:1000])
        why = f"{path} has 1000 bytes, its manifest {len(body)} (truncated or altered after import)"
    else:
        path.write_bytes(body.replace(b"GeneratedTokens", b"GeneratedTokenz"))
        why = f"{path} does not match its sha256 (altered after import)"
    code, err = run_cli(["run", "runtime=sim", "workload=azure_code", "workload.max_requests=3",
                         f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "data", tmp_path)
    assert code == 2 and err == [
        f"error: dataset 'azure-code-2023' (needed by workload=azure_code): {why}; bring it again with "
        "`testbed data fetch azure-code-2023` or, from a local copy, `testbed data import azure-code-2023 DIR`"]


# ---- data.dir in the run config ---------------------------------------------------

def azure_lengths(csv: Path, n: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    rows = csv.read_text().splitlines()[1:n + 1]
    return [(min(int(r.split(",")[1]), max_prompt), min(int(r.split(",")[2]), max_output)) for r in rows]


def test_a_run_reads_azure_code_from_the_data_dir_given_only_by_data_dir(tmp_path):
    """$TESTBED_DATA names an empty directory: data.dir wins over it."""
    mine = tmp_path / "my data"
    import_dataset("azure-code-2023", SHARED_DATA, data_dir=mine)
    code, err = run_cli(["run", "runtime=sim", "workload=azure_code", "workload.max_requests=4",
                         f"data.dir={mine}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "empty", tmp_path)
    assert code == 0, err
    got = [(r["prompt_len"], len(r["output_token_ids"])) for r in
           map(json.loads, (tmp_path / "run" / "requests.jsonl").read_text().splitlines())]
    assert got == azure_lengths(mine / "azure-code-2023" / "AzureLLMInferenceTrace_code.csv", 4, 1024, 256)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["num_requests"] == 4
    assert not (tmp_path / "empty").exists()


def test_a_dataset_missing_under_data_dir_is_one_line_naming_that_directory(tmp_path, data_dir):
    """$TESTBED_DATA holds the dataset, data.dir does not: the run stops, naming data.dir's directory."""
    empty = tmp_path / "empty"
    code, err = run_cli(["run", "runtime=sim", "workload=azure_code", f"data.dir={empty}",
                         f"hydra.run.dir={tmp_path / 'run'}"], data_dir, tmp_path)
    assert code == 2 and err == [
        f"error: workload=azure_code needs the dataset 'azure-code-2023', not in the data directory {empty} "
        "(data.dir or $TESTBED_DATA, default ~/.cache/pd-testbed); bring it with `testbed data fetch "
        "azure-code-2023` or, from a local copy, `testbed data import azure-code-2023 DIR`"]
    assert not (tmp_path / "run" / "requests.jsonl").exists()


def test_real_worker_processes_price_from_the_data_dir_given_only_by_data_dir(tmp_path, data_dir):
    """runtime=real on a GPU preset: every worker process rebuilds the
    hardware preset, which checks its operator tables, from data.dir."""
    code, err = run_cli(["run", "runtime=real", "mode=disagg", "hardware=h100-sxm", "num_kv_blocks=64",
                         "token_budget=64", "workload.num_requests=2", "workload.prompt_dist=fixed",
                         "workload.prompt_len=8", "workload.output_dist=fixed", "workload.output_len=2",
                         f"data.dir={data_dir}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "empty", tmp_path)
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["num_requests"] == 2


def test_data_dir_naming_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("")
    code, err = run_cli(["run", "runtime=sim", f"data.dir={tmp_path / 'f'}", f"hydra.run.dir={tmp_path / 'run'}"],
                        tmp_path / "empty", tmp_path)
    assert code == 2 and err == [f"error: data.dir: '{tmp_path / 'f'}' is a file, not a directory; name the data "
                                 "directory (`testbed data list --dir DIR` shows what one holds) or leave it unset "
                                 "for $TESTBED_DATA"]


# ---- import ---------------------------------------------------------------------

def test_import_refuses_a_wrong_copy_and_leaves_nothing(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SHARED_DATA / "blis-h100", src)
    (src / "kernels" / "gemm" / "h100" / "data.csv").write_text("m,k,n,latency_us,mfu\n1,2,3,4,5\n")
    with pytest.raises(DataError) as e:
        import_dataset("blis-h100", src, data_dir=tmp_path / "data")
    assert str(e.value).startswith("dataset 'blis-h100': kernels/gemm/h100/data.csv has sha256 ")
    assert str(e.value).endswith("(a different or damaged copy); nothing was installed")
    assert entries(tmp_path / "data") == []


def test_import_of_a_folder_lacking_a_file_names_it(tmp_path):
    src = SHARED_DATA / "blis-h100"            # the wrong folder: it has a LICENSE, no compute/
    files = known_manifest("vidur-profiles").files
    missing = [f.path for f in files if not (src / f.path).is_file()]
    with pytest.raises(DataError) as e:
        import_dataset("vidur-profiles", src, data_dir=tmp_path)
    assert str(e.value) == (f"import vidur-profiles: {src / missing[0]} is missing ({len(files) - 1} of {len(files)} "
                            "files); give the folder that holds the dataset's files at their paths")
    assert entries(tmp_path) == []


def test_a_second_import_replaces_the_first_and_link_links(tmp_path):
    import_dataset("azure-code-2023", SHARED_DATA, data_dir=tmp_path)
    where = import_dataset("azure-code-2023", SHARED_DATA, data_dir=tmp_path, link=True)
    csv = where / "AzureLLMInferenceTrace_code.csv"
    assert csv.is_symlink() and csv.resolve() == (SHARED_DATA / "AzureLLMInferenceTrace_code.csv").resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["azure-code-2023"]


def test_a_users_own_trace_registers_under_a_name_and_a_workload_replays_it(tmp_path):
    src = tmp_path / "mine"
    src.mkdir()
    (src / "t.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                               "2024-05-01 10:00:00,100,3\n2024-05-01 10:00:01,50,2\n")
    assert data_main(["import", "my-trace", str(src), "--as-trace", "--dir", str(tmp_path / "data")]) == 0
    manifest = json.loads((tmp_path / "data" / "my-trace" / ".manifest.json").read_text())
    assert manifest["kind"] == "trace" and [f["path"] for f in manifest["files"]] == ["t.csv"]
    code, err = run_cli(["run", "runtime=sim", "workload.arrival=trace", "workload.prompt_dist=trace",
                         "workload.output_dist=trace", "workload.trace_dataset=my-trace",
                         "workload.trace_path=t.csv", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "data", tmp_path)
    assert code == 0, err
    lines = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(ln)["prompt_len"] for ln in lines] == [100, 50]


def test_a_users_own_name_may_not_shadow_a_known_one(tmp_path, capsys):
    assert data_main(["import", "vidur-profiles", str(tmp_path), "--as-profile", "--dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("error: import vidur-profiles: 'vidur-profiles' is a known dataset's name; "
                                       "register your own under another name\n")


# ---- list -----------------------------------------------------------------------

def test_list_says_what_is_present_where_its_size_licence_and_citation(tmp_path, capsys):
    import_dataset("azure-code-2023", SHARED_DATA, data_dir=tmp_path)
    assert data_main(["list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"data directory: {tmp_path}"
    assert out[1] == f"azure-code-2023 (trace, 1 file, 312.6 KiB): present, {tmp_path / 'azure-code-2023'}"
    assert out[3].startswith("  licence: CC-BY-4.0") and out[4].startswith("  cite: Patel et al., \"Splitwise")
    assert out[5] == ("blis-h100 (profile, 33 files, 224.5 KiB): absent; `testbed data fetch blis-h100` or "
                      "`testbed data import blis-h100 DIR`")
    assert out[9].startswith("vidur-profiles (profile, 26 files, 11.6 MiB): absent")
    assert len(out) == 13


# ---- fetch against a server on loopback -------------------------------------------

class Files(http.server.BaseHTTPRequestHandler):
    """Serves `files` by path; `lie` adds bytes to the Content-Length it sends
    and closes early: a download cut off."""
    files: dict[str, bytes] = {}
    lie: int = 0

    def do_GET(self):
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + self.lie))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("H", (Files,), {"files": {}, "lie": 0}))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


TINY = {"a.csv": b"x,y\n1,2\n", "sub/b.txt": b"hello\n"}


def tiny_manifest(base: str, files: dict[str, bytes] = TINY) -> Manifest:
    return Manifest(name="tiny", title="tiny", kind="profile", source=base, licence="CC0", citation="none",
                    files=tuple(DataFile(p, hashlib.sha256(b).hexdigest(), len(b), url=f"{base}/{p}")
                                for p, b in files.items()))


def base_url(httpd) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def test_fetch_installs_every_file_checked(server, tmp_path):
    server.RequestHandlerClass.files = {f"/{p}": b for p, b in TINY.items()}
    where = fetch_manifest(tiny_manifest(base_url(server)), tmp_path)
    assert (where / "a.csv").read_bytes() == TINY["a.csv"] and (where / "sub" / "b.txt").read_bytes() == TINY["sub/b.txt"]
    assert entries(tmp_path) == ["tiny", "tiny/.manifest.json", "tiny/a.csv", "tiny/sub", "tiny/sub/b.txt"]


def test_fetch_a_file_whose_checksum_differs(server, tmp_path):
    server.RequestHandlerClass.files = {"/a.csv": TINY["a.csv"], "/sub/b.txt": b"HELLO\n"}
    with pytest.raises(DataError) as e:
        fetch_manifest(tiny_manifest(base_url(server)), tmp_path)
    assert str(e.value).startswith("dataset 'tiny': sub/b.txt has sha256 ") and "\n" not in str(e.value)
    assert entries(tmp_path) == []


def test_fetch_a_truncated_download(server, tmp_path):
    server.RequestHandlerClass.files = {f"/{p}": b for p, b in TINY.items()}
    server.RequestHandlerClass.lie = 100
    url = f"{base_url(server)}/a.csv"
    with pytest.raises(DataError) as e:
        fetch_manifest(tiny_manifest(base_url(server)), tmp_path)
    assert str(e.value) == (f"fetch tiny: the download of {url} ended after 8 of 108 bytes (truncated); run fetch "
                            "again, or bring it from a local copy with `testbed data import tiny DIR`; nothing was "
                            "installed")
    assert entries(tmp_path) == []


def test_fetch_a_file_missing_at_its_source(server, tmp_path):
    server.RequestHandlerClass.files = {"/a.csv": TINY["a.csv"]}
    with pytest.raises(DataError) as e:
        fetch_manifest(tiny_manifest(base_url(server)), tmp_path)
    assert str(e.value) == (f"fetch tiny: {base_url(server)}/sub/b.txt answered HTTP 404 Not Found (the file is not "
                            "at its source); bring it from a local copy with `testbed data import tiny DIR`")
    assert entries(tmp_path) == []


def test_fetch_with_the_connection_refused(tmp_path):
    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    with pytest.raises(DataError) as e:
        fetch_manifest(tiny_manifest(base), tmp_path)
    assert str(e.value) == (f"fetch tiny: cannot reach {base}/a.csv (Connection refused); without network, bring it "
                            "from a local copy with `testbed data import tiny DIR`")
    assert entries(tmp_path) == []


def test_fetch_refuses_a_dataset_with_a_file_made_locally(tmp_path, capsys):
    assert data_main(["fetch", "blis-h100", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fetch blis-h100: vllm-0.11-runs/") and err.count("\n") == 1
    assert err.endswith("bring it from a local copy with `testbed data import blis-h100 DIR`\n")
    assert entries(tmp_path) == []
    with pytest.raises(DataError, match="^fetch nope: not a known dataset; choose one of: azure-code-2023, "):
        fetch_dataset("nope", tmp_path)


# ---- derived tables ---------------------------------------------------------------

def test_condensed_tables_are_derived_once_and_keyed_by_the_sources_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_DATA", str(tmp_path))
    import_dataset("vidur-profiles", SHARED_DATA / "vidur-profiles", data_dir=tmp_path)
    first = tables_dir("vidur-profiles", "a test")
    checksum = known_manifest("vidur-profiles").checksum
    assert first.parent == tmp_path / "derived" / "vidur-profiles" / "condensed-tables"
    assert first.name.startswith(checksum[:16] + "-")
    stamp = (first / "compute" / "h100" / "models.csv").stat().st_mtime_ns
    assert tables_dir("vidur-profiles", "a test") == first
    assert (first / "compute" / "h100" / "models.csv").stat().st_mtime_ns == stamp     # found, not made again
    # a user's own profile in Vidur's layout gets its own entry
    own = tmp_path / "own"
    shutil.copytree(SHARED_DATA / "vidur-profiles" / "network", own / "network")
    shutil.copytree(SHARED_DATA / "vidur-profiles" / "compute" / "h100", own / "compute" / "h100")
    import_dataset("my-profile", own, data_dir=tmp_path, as_kind="profile")
    mine = tables_dir("my-profile", "a test")
    assert mine.parent.parent.name == "my-profile" and mine != first
    assert sorted(p.name for p in (mine / "compute").iterdir()) == ["h100"]


def test_a_preset_with_tables_but_no_dataset_named_is_refused():
    from testbed.sim.config import load_hardware_preset
    with pytest.raises(ValueError) as e:
        load_hardware_preset("cpu", gemm_table="h100")
    assert str(e.value) == ("hardware.operator_tables: not set, but gemm_table or allreduce_table is; name the "
                            "profile dataset they come from, e.g. hardware.operator_tables=vidur-profiles")
