"""Other people's files: nothing in them runs, and no write follows a symbolic link out of its folder.

A planted pickle in ``trainer_state.pt`` (its manifest and marker made consistent, so the integrity checks pass)
is refused by ``trainer.resume=auto`` and ``=<its folder>`` and runs nothing; an older checkpoint (numpy's RNG
state as an ndarray) still resumes bitwise. A symbolic link where the tool writes (the lock, the export folder's
files, the run folder's files and folders, caches, ``prepare data``'s files, ``--json``) is refused, naming it, or
replaced by the tool's own file: what it points at is never written."""
import hashlib
import json
import os
import shutil

import pytest
import torch

from specopd.cli import main
from specopd.data import formats as F
from specopd.data.prepare import load_tokenizer
from specopd.errors import LinkedPathError, open_write, own_dir, remove_path, replacing, write_replace
from specopd.profiling import append_spans
from specopd.runs import checkpoint as ck
from specopd.train.loop import train
from test_data import char_target
from tiny_runs import TINY_TEST_OVERRIDES, tiny_recipe

STEPS = 4
PRECIOUS = "precious: not the tool's to write\n"


def _cfg(out, *extra):
    return tiny_recipe(str(out), [f"trainer.max_steps={STEPS}", "trainer.eval_heldout=false", "trainer.save_every=2",
                                  "trainer.keep_last=3", *extra])


def _train(capsys, out, *extra):
    """``specopd train`` in-process, the same run as ``_cfg`` -> (exit code, stdout, stderr)."""
    recipe = str(out) + ".recipe.yaml"
    if not os.path.isfile(recipe):
        open(recipe, "w").write("seed: 0\n")
    capsys.readouterr()
    rc = main(["train", recipe, *TINY_TEST_OVERRIDES, "model.target=tiny:llama", f"trainer.output_dir={out}",
               f"trainer.max_steps={STEPS}", "trainer.eval_heldout=false", "trainer.save_every=2",
               "trainer.keep_last=3", *extra])
    o = capsys.readouterr()
    return rc, o.out, o.err


def _refused(rc, out, err, code, *needles):
    assert rc == code, (rc, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in err, (n, err[-3000:])


def _victim(tmp_path, name="victim.txt"):
    """A file of someone's that a planted link points at."""
    p = tmp_path / name
    p.write_text(PRECIOUS)
    return p


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("run")
    train(_cfg(out), progress=False)
    return str(out)


def _copy(run, dst):
    shutil.copytree(run, dst, symlinks=True)
    return str(dst)


def _step(out, k):
    return os.path.join(str(out), "checkpoints", f"step-{k}")


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _reseal(step_dir):
    """Make the manifest and the marker agree with the files as they are now (what someone planting a file
    would do): the integrity checks pass, so only the loader stands between the file and a resume."""
    mpath = os.path.join(step_dir, ck.MANIFEST)
    man = json.load(open(mpath))
    for name in man["files"]:
        p = os.path.join(step_dir, name)
        man["files"][name] = {"bytes": os.path.getsize(p), "sha256": _sha(p)}
    json.dump(man, open(mpath, "w"), indent=1)
    marker = json.load(open(os.path.join(step_dir, ck.MARKER)))
    marker["manifest_sha256"] = _sha(mpath)
    json.dump(marker, open(os.path.join(step_dir, ck.MARKER), "w"))
    assert ck.verify(step_dir) is None


class _Payload:
    """Unpickled, it writes ``marker``: the proof that a load ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_a_planted_pickle_is_refused_and_runs_nothing(run, tmp_path, capsys):
    out = _copy(run, tmp_path / "run")
    newest, marker = _step(out, STEPS), tmp_path / "payload-ran"
    state = os.path.join(newest, "trainer_state.pt")
    ts = torch.load(state, weights_only=True)  # the real state, with the payload inside
    ts["scheduler"]["note"] = _Payload(marker)
    torch.save(ts, state)
    _reseal(newest)
    metrics = open(os.path.join(out, "metrics.jsonl")).read()
    for resume in ("auto", newest):
        rc, so, err = _train(capsys, out, "trainer.max_steps=6", f"trainer.resume={resume}")
        _refused(rc, so, err, 1, f"{state} holds objects a checkpoint never holds (builtins.exec)",
                 "not loaded, as loading them could run code")
        assert not marker.exists()  # nothing ran
        assert os.path.isdir(newest) and not os.path.exists(newest + ".damaged")  # not damage: nothing moved
        assert not os.path.exists(_step(out, 6))
        assert open(os.path.join(out, "metrics.jsonl")).read() == metrics
    assert f"trainer.resume={newest}" in err
    torch.load(state, weights_only=False)  # the file is live: loading it the old way runs it
    assert marker.read_text() == "ran"


def test_an_older_checkpoint_with_numpy_inside_resumes_bitwise(run, tmp_path, capsys):
    out = _copy(run, tmp_path / "run")
    shutil.rmtree(_step(out, STEPS))
    state = os.path.join(_step(out, 2), "trainer_state.pt")
    ts = ck.read_trainer_state(state)  # numpy's state comes back as numpy's tuple: save it as older code did
    assert type(ts["controller_rng"]["numpy"][1]).__module__ == "numpy"
    torch.save(ts, state)
    _reseal(_step(out, 2))
    with pytest.raises(Exception, match="numpy"):  # numpy objects inside: not loadable without the allow-list
        torch.load(state, weights_only=True)
    rc, so, err = _train(capsys, out)
    assert rc == 0, err[-3000:]
    assert f"resumed from {_step(out, 2)}" in so
    # bitwise the uninterrupted run's step: the weights' bytes, and every value of the trainer state (its pickle's
    # bytes differ after any resume, the older format's or not: object sharing, not values)
    name = "model.safetensors"
    assert _sha(os.path.join(_step(out, STEPS), name)) == _sha(os.path.join(_step(run, STEPS), name))
    got, want = (_values(ck.read_trainer_state(os.path.join(_step(r, STEPS), "trainer_state.pt"))) for r in (out, run))
    assert got == want and len(got) > 50


def _values(x, key=""):
    """Every value of a nested state as (key, dtype, shape, bytes) / (key, repr), in a fixed order."""
    if isinstance(x, dict):
        return [v for k in sorted(x, key=str) for v in _values(x[k], f"{key}/{k}")]
    if isinstance(x, (list, tuple)):
        return [v for i, e in enumerate(x) for v in _values(e, f"{key}[{i}]")]
    if torch.is_tensor(x):
        return [(key, str(x.dtype), tuple(x.shape), x.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())]
    return [(key, repr(x))]


def test_a_trainer_state_of_another_shape_is_named(run, tmp_path):
    d = _copy(_step(run, 2), tmp_path / "step-2")
    for junk in ([1, 2], {"optimizer": {}}):
        torch.save(junk, os.path.join(d, "trainer_state.pt"))
        _reseal(d)
        with pytest.raises(ck.CheckpointError, match="is not a trainer state"):
            ck.load_checkpoint(d)


# ---------------------------------------------------------------------------------------------- links: the run folder
def test_a_symlinked_lock_is_refused_and_its_target_unchanged(tmp_path, capsys):
    victim = _victim(tmp_path)
    for name, to in (("run", victim), ("dangling", tmp_path / "nowhere")):
        out = tmp_path / name
        out.mkdir()
        os.symlink(to, out / ".specopd.lock")
        for dry in ([], ["--dry-run"]):  # the dry run says what the run would
            rc, so, err = _train(capsys, out, *dry)
            _refused(rc, so, err, 2, f"{out / '.specopd.lock'} is a symbolic link", "remove the link")
        assert sorted(os.listdir(out)) == [".specopd.lock"]  # nothing else written
    assert victim.read_text() == PRECIOUS
    assert not (tmp_path / "nowhere").exists()


def test_links_in_a_run_folder_are_refused_or_replaced_never_followed(run, tmp_path, capsys):
    victim = _victim(tmp_path)
    # a resume: metrics.jsonl is read and rewritten, so a link there is refused
    out = _copy(run, tmp_path / "metrics")
    os.remove(os.path.join(out, "metrics.jsonl"))
    os.symlink(victim, os.path.join(out, "metrics.jsonl"))
    rc, so, err = _train(capsys, out, "trainer.max_steps=6")
    _refused(rc, so, err, 2, f"{out}/metrics.jsonl is a symbolic link")
    # fresh runs: a linked recipe.yaml, synthetic-data cache folder or checkpoints/ is refused; checkpoints/ before
    # the first step (not at the first save, which would lose the steps), in the dry run too
    away = tmp_path / "away"
    away.mkdir()
    for name, to, extra in (("recipe.yaml", victim, []), ("data", away, []),
                            ("checkpoints", away, ["trainer.max_steps=2"]), ("checkpoints", away, ["--dry-run"])):
        out = tmp_path / f"fresh-{name}-{len(extra and extra[0])}"
        out.mkdir()
        os.symlink(to, out / name)
        rc, so, err = _train(capsys, out, *extra)
        _refused(rc, so, err, 2, f"{out}/{name} is a symbolic link")
        assert not (out / "metrics.jsonl").exists()  # refused before any step
    assert victim.read_text() == PRECIOUS and os.listdir(away) == []


def test_links_at_tmp_names_latest_and_caches_are_replaced_not_followed(run, tmp_path, capsys):
    victim, away = _victim(tmp_path), tmp_path / "away"
    away.mkdir()
    out = _copy(run, tmp_path / "run")
    shutil.rmtree(_step(out, STEPS))
    root, pid = os.path.join(out, "checkpoints"), os.getpid()  # this process writes the save
    os.remove(os.path.join(root, "latest"))
    os.symlink(victim, os.path.join(root, "latest"))
    os.symlink(victim, os.path.join(root, f".latest-{pid}"))
    os.symlink(away, os.path.join(root, f".tmp-step-{STEPS}-{pid}"))
    os.remove(os.path.join(out, ".fingerprints.json"))
    os.symlink(victim, os.path.join(out, ".fingerprints.json"))
    rc, so, err = _train(capsys, out)
    assert rc == 0, err[-3000:]
    assert open(os.path.join(root, "latest")).read() == f"step-{STEPS}\n" and not os.path.islink(os.path.join(root,
                                                                                                            "latest"))
    assert not os.path.islink(os.path.join(out, ".fingerprints.json"))
    assert sorted(os.listdir(root)) == ["latest", "step-2", f"step-{STEPS}"]
    assert _sha(os.path.join(_step(out, STEPS), "model.safetensors")) == _sha(os.path.join(_step(run, STEPS),
                                                                                       "model.safetensors"))
    assert victim.read_text() == PRECIOUS and os.listdir(away) == []


def test_a_damaged_synthetic_cache_is_sampled_again_with_a_note(run, tmp_path, capsys):
    out = _copy(run, tmp_path / "run")
    (cache,) = [os.path.join(out, "data", n) for n in os.listdir(os.path.join(out, "data"))]
    os.truncate(cache, os.path.getsize(cache) // 2)
    rc, so, err = _train(capsys, out, "trainer.resume=none")
    assert rc == 0, err[-3000:]
    assert f"note: the synthetic-data cache {cache} is unreadable" in so and "sampling it again" in so
    assert _sha(cache) == _sha(os.path.join(run, "data", os.path.basename(cache)))  # the same samples, rebuilt
    assert _sha(os.path.join(_step(out, STEPS), "model.safetensors")) == _sha(os.path.join(_step(run, STEPS),
                                                                                       "model.safetensors"))


# ---------------------------------------------------------------------------------------------- links: other outputs
def test_export_with_force_writes_nothing_through_links(run, tmp_path, capsys):
    victim, outside = _victim(tmp_path), tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "served"
    dst.mkdir()
    os.symlink(outside / "config.json", dst / "config.json")  # dangling: following it would create the file
    os.symlink(victim, dst / "model.safetensors")
    os.symlink(victim, dst / "notes.txt")  # not a drafter file: kept as it is
    assert main(["export", _step(run, STEPS), str(dst)]) == 2  # without --force: refused, as any used folder
    assert main(["export", _step(run, STEPS), str(dst), "--force"]) == 0
    assert os.listdir(outside) == [] and victim.read_text() == PRECIOUS
    for n in ("config.json", "model.safetensors"):
        assert not os.path.islink(dst / n) and os.path.isfile(dst / n)
    assert os.path.islink(dst / "notes.txt")


@pytest.mark.parametrize("name", ["data.jsonl", "errors.jsonl", "skipped.jsonl", "meta.json", ".engine"])
def test_prepare_data_refuses_links_before_writing(tmp_path, capsys, name):
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / name)
    pf = tmp_path / "prompts.jsonl"
    pf.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    capsys.readouterr()
    rc = main(["prepare", "data", "--target", str(tmp_path / "target-not-read"), "--prompts", str(pf),
               "--max-new-tokens", "2", "--out", str(out)])
    _refused(rc, "", capsys.readouterr().err, 2, f"{out / name} is a symbolic link")
    assert victim.read_text() == PRECIOUS and sorted(os.listdir(out)) == sorted([".specopd.lock", name])


def test_a_json_output_that_is_a_link_is_refused(tmp_path, capsys):
    victim = _victim(tmp_path)
    link = tmp_path / "plan.json"
    os.symlink(victim, link)
    rc, so, err = _train(capsys, tmp_path / "run", "--dry-run", "--json", str(link))
    _refused(rc, so, err, 2, f"--json '{link}' cannot be written: it is a symbolic link")
    assert victim.read_text() == PRECIOUS


def test_a_linked_tokenisation_cache_folder_is_passed_over(tmp_path):
    target_dir = char_target(tmp_path / "target")
    tok = load_tokenizer(target_dir, 128)
    data = tmp_path / "shared"
    data.mkdir()
    p = data / "c.jsonl"
    p.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}) + "\n"
        for i in range(3)))
    away = tmp_path / "away"
    away.mkdir()
    os.symlink(away, data / ".specopd-cache")
    got = F.build_cache(str(p), tok, target_dir, str(tmp_path / "run"))
    assert got["path"].startswith(str(tmp_path / "run" / "data")) and os.path.isfile(got["path"])
    assert os.listdir(away) == []


def test_profile_files_are_not_written_through_links(tmp_path):
    victim, away = _victim(tmp_path), tmp_path / "away"
    away.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.symlink(away, run_dir / "profile")
    with pytest.raises(LinkedPathError, match="profile is a symbolic link"):
        append_spans(run_dir, [("w0", "step", 0.0, 1.0)])
    os.remove(run_dir / "profile")
    (run_dir / "profile").mkdir()
    os.symlink(victim, run_dir / "profile" / "spans.jsonl")
    with pytest.raises(LinkedPathError, match="spans.jsonl is a symbolic link"):
        append_spans(run_dir, [("w0", "step", 0.0, 1.0)])
    assert victim.read_text() == PRECIOUS and os.listdir(away) == []


# ---------------------------------------------------------------------------------------------- the helpers
def test_the_write_helpers_never_follow_a_link(tmp_path):
    victim, folder = _victim(tmp_path), tmp_path / "d"
    folder.mkdir()
    for mode in ("w", "a", "wb", "ab"):
        for to in (victim, tmp_path / "missing"):
            link = folder / f"l-{mode}"
            os.symlink(to, link)
            with pytest.raises(LinkedPathError, match=f"{link} is a symbolic link .*remove the link"):
                open_write(str(link), mode)
            os.remove(link)
    assert not (tmp_path / "missing").exists()
    # a replaced file: a link at the tmp name or at the file is dropped, what they point at untouched
    target = folder / "f.json"
    os.symlink(victim, folder / f"f.json.tmp-{os.getpid()}")
    os.symlink(victim, target)
    write_replace(str(target), "{}")
    assert target.read_text() == "{}" and not os.path.islink(target)
    with pytest.raises(KeyError):  # a failed write leaves the old file and no tmp file
        with replacing(str(target)) as f:
            f.write("half")
            raise KeyError
    assert target.read_text() == "{}" and sorted(os.listdir(folder)) == ["f.json"]
    os.symlink(tmp_path, folder / "sub")
    with pytest.raises(LinkedPathError):
        own_dir(str(folder / "sub"))
    remove_path(str(folder / "sub"))  # the link goes, not the folder it points at
    assert not os.path.lexists(folder / "sub") and victim.read_text() == PRECIOUS


# ---------------------------------------------------------------------------------------------- what runs: nothing
def test_a_manifest_naming_files_outside_its_folder_is_damage(run, tmp_path):
    d = _copy(_step(run, 2), tmp_path / "ckpts" / "step-2")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"someone else's file")
    mpath = os.path.join(d, ck.MANIFEST)
    entry = {"bytes": outside.stat().st_size, "sha256": _sha(outside)}  # what the file really is: it would pass
    for name in ("../../outside.bin", str(outside)):
        man = json.load(open(mpath))
        man["files"] = {**man["files"], name: entry}
        json.dump(man, open(mpath, "w"))
        marker = json.load(open(os.path.join(d, ck.MARKER)))
        json.dump(dict(marker, manifest_sha256=_sha(mpath)), open(os.path.join(d, ck.MARKER), "w"))
        assert ck.verify(d) == f"manifest.json lists {name!r}, which is not a file of this folder (a manifest " \
                               f"lists its own files)"
        with pytest.raises(ck.CheckpointError, match="not a file of this folder"):
            ck.load_checkpoint(d)
        man["files"].pop(name)
        json.dump(man, open(mpath, "w"))


def test_a_python_object_recipe_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "recipe-ran"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"seed: !!python/object/apply:os.system [\"touch {marker}\"]\n")
    for argv in (["train", str(recipe), "--dry-run"], ["train", str(recipe)],
                 ["eval", str(recipe), f"trainer.output_dir={tmp_path / 'run'}"]):
        capsys.readouterr()
        rc = main(argv)
        _refused(rc, "", capsys.readouterr().err, 2, str(recipe))
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_auto_map_in_target_tokenizer_and_drafter_folders_imports_nothing(run, tmp_path):
    from specopd.drafters import load_drafter
    from specopd.models import load_target

    marker = tmp_path / "module-ran"
    evil = f"open({str(marker)!r}, 'w').write('ran')\nclass A: pass\n"
    target_dir = char_target(tmp_path / "target")
    for f in ("config.json", "tokenizer_config.json"):
        p = os.path.join(target_dir, f)
        cfg = json.load(open(p))
        cfg["auto_map"] = {"AutoConfig": "evil.A", "AutoModel": "evil.A", "AutoModelForCausalLM": "evil.A",
                           "AutoTokenizer": ["evil.A", None]}
        json.dump(cfg, open(p, "w"))
    open(os.path.join(target_dir, "evil.py"), "w").write(evil)
    load_tokenizer(target_dir, 128)
    load_target(target_dir)
    drafter_dir = tmp_path / "drafter"
    assert main(["export", _step(run, STEPS), str(drafter_dir)]) == 0
    cfg = json.load(open(drafter_dir / "config.json"))
    module = cfg["auto_map"]["AutoModel"].split(".")[0]  # the released layout names its HF code: plant it
    (drafter_dir / f"{module}.py").write_text(evil)
    load_drafter(str(drafter_dir), load_target(os.path.join(run, "tiny-target-llama")))
    assert not marker.exists()


def test_a_pickle_in_a_data_cache_runs_nothing_and_is_rebuilt(tmp_path):
    target_dir = char_target(tmp_path / "target")
    tok = load_tokenizer(target_dir, 128)
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}) + "\n"
        for i in range(3)))
    first = F.build_cache(str(p), tok, target_dir, str(tmp_path / "run"))
    marker = tmp_path / "cache-ran"
    torch.save([_Payload(marker)], first["path"])  # a planted cache beside someone's data
    again = F.build_cache(str(p), tok, target_dir, str(tmp_path / "run"))
    assert again == {"path": first["path"], "hit": False} and not marker.exists()
    assert F.build_cache(str(p), tok, target_dir, str(tmp_path / "run"))["hit"] is True


def _big_server(declare: bool):
    """An OpenAI-compatible server whose completions are 50 MB of JSON (its length declared or not)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sent = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *a):
            pass

        def do_GET(self):
            data = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            chunk, n = b"7, " * (1 << 20), 50 << 20
            self.send_response(200)
            if declare:
                self.send_header("Content-Length", str(n + 40))
            self.end_headers()
            try:
                self.wfile.write(b'{"choices": [{"finish_reason": "length", "token_ids": [')
                for _ in range(n // len(chunk)):
                    self.wfile.write(chunk)
                    sent.append(len(chunk))
            except OSError:
                pass  # the client stopped reading

    class Quiet(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            pass

    httpd = Quiet(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, sent


@pytest.mark.parametrize("declare", [True, False])
def test_a_huge_server_reply_is_refused_small_and_fast(tmp_path, declare):
    import time

    from specopd.data import prepare as P
    from specopd.data import references as R
    from specopd.engines import openai_api as O

    target_dir = char_target(tmp_path / "target")
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"id": "a", "prompt": "say a"}) + "\n")
    httpd, sent = _big_server(declare)
    try:
        t0 = time.monotonic()
        c = P.prepare_data(target_dir, str(tmp_path / "out"), str(pf), max_new_tokens=4, temperature=0.0,
                           progress=False, engine="openai", servers=f"http://127.0.0.1:{httpd.server_address[1]}")
        took = time.monotonic() - t0
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert c["failed"] == 1 and c["written"] == 0
    (err,) = R.read_records(str(tmp_path / "out" / P.ERRORS_FILE))
    bound = O.reply_bound(len(P.encode_prompt(load_tokenizer(target_dir, 128), [{"role": "user", "content": "say a"}]))
                          + 4)
    assert f"answered more than {bound} bytes" in err["error"] and err["attempts"] == 1, err
    assert (f"{(50 << 20) + 40} declared" if declare else "no length declared") in err["error"], err
    assert took < 20, took  # refused after at most the bound, not after reading 50 MB
    assert sum(sent) < (20 << 20)  # the client stopped reading (what the socket buffers took aside)
