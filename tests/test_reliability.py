"""The second hardening round: one writer per run folder, every checkpoint read verified, a resume refused when its
data or target changed, nothing written before a run is accepted, a clear message (exit 2, no traceback) for each
mistake a user can make through the CLI, and byte-reproducible checkpoints."""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from specopd.cli import main
from specopd.runs import checkpoint as ck
from specopd.train.checkpointer import RecipeChangeError
from specopd.train.loop import train
from tiny_runs import TINY_TEST_OVERRIDES, run_cli, tiny_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "tiny.yaml")
STEPS = 4


def _cfg(out, *extra):
    return tiny_recipe(str(out), [f"trainer.max_steps={STEPS}", "trainer.eval_heldout=false", *extra])


def _args(out, *extra):
    return TINY_TEST_OVERRIDES + ["model.target=tiny:llama", f"trainer.output_dir={out}", f"trainer.max_steps={STEPS}",
                                  "trainer.eval_heldout=false", *extra]


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("SPECOPD_DEBUG", None)
    return env


def _specopd(*argv, timeout=600):
    """``python -m specopd.cli ARGV`` in a subprocess -> (exit code, stdout, stderr)."""
    r = subprocess.run([sys.executable, "-m", "specopd.cli", *map(str, argv)], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def _refused(rc, out, err, *needles):
    """Exit code 2, every needle in stderr, no traceback."""
    assert rc == 2, (rc, out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in err, (n, err[-3000:])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("run")
    train(_cfg(out, "trainer.save_every=2", "trainer.keep_last=3"), progress=False)
    return str(out)


def _copy(run, dst):
    shutil.copytree(run, dst)
    return str(dst)


def _poison_fc(step_dir):
    """Overwrite fc.weight's first value with inf in place: same size, other sha256."""
    from safetensors import safe_open

    f = os.path.join(step_dir, "model.safetensors")
    with safe_open(f, "pt") as sf:
        names = list(sf.keys())
    n = int.from_bytes(open(f, "rb").read(8), "little")
    head = json.loads(open(f, "rb").read(8 + n)[8:])
    off = 8 + n + head["fc.weight"]["data_offsets"][0]
    assert "fc.weight" in names
    with open(f, "r+b") as fh:
        fh.seek(off)
        fh.write(torch.tensor([float("inf")], dtype=torch.float32).numpy().tobytes())


# ---------------------------------------------------------------------------------------------- one writer
_HOLD = textwrap.dedent("""
    import sys, time
    from specopd.runs.lock import acquire
    acquire(sys.argv[1], "trainer.output_dir")
    print("held", flush=True)
    time.sleep(120)
""")


def _holder(folder):
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=_env())
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_is_refused_at_once_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        t0 = time.time()
        rc, so, err = _specopd("train", RECIPE, *_args(out))
        _refused(rc, so, err, f"trainer.output_dir='{out}' is in use by pid {holder.pid} on host "
                              f"{socket.gethostname()}", "one writer per folder")
        assert time.time() - t0 < 60 and not os.path.exists(out / "recipe.yaml")  # refused before any work
        assert not os.path.exists(out / "checkpoints") and not os.path.exists(out / "metrics.jsonl")
        capsys.readouterr()
        assert main(["train", RECIPE, *_args(out), "--dry-run"]) == 0  # the plan says so, and writes nothing
        assert f"is in use by pid {holder.pid} on host" in capsys.readouterr().out
        data = tmp_path / "data"
        holder2 = _holder(data)
        try:
            capsys.readouterr()
            rc = main(["prepare", "data", "--target", str(tmp_path / "no-target"), "--out", str(data)])
            _refused(rc, "", capsys.readouterr().err, f"prepare data --out='{data}' is in use by pid {holder2.pid}")
        finally:
            holder2.kill()
            holder2.wait()
    finally:
        holder.kill()
        holder.wait()
    # the holder was killed: its lock is gone with it, and the next run takes it (with a note)
    train(_cfg(out, "trainer.max_steps=1"), progress=False)
    assert ck.find_latest(str(out)).endswith("step-1")


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, capsys):
    from specopd.runs.lock import LOCK_FILE, acquire, read_holder, release

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    rec = {"pid": dead.pid, "host": host, "started": time.time() - 60, "command": "specopd train old"}
    # 1) a killed run left its record, no process holds the flock
    d1 = tmp_path / "a"
    d1.mkdir()
    (d1 / LOCK_FILE).write_text(json.dumps(rec))
    acquire(str(d1))
    assert read_holder(str(d1))["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"taking over the lock left by pid {dead.pid} on host {host}" in err
    release(str(d1))
    assert read_holder(str(d1)) is None  # a clean release empties the record
    # 2) the flock is still held (an inherited descriptor lives on) but the recorded process is gone
    d2 = tmp_path / "b"
    d2.mkdir()
    hold = textwrap.dedent(f"""
        import fcntl, json, os, sys, time
        fd = os.open({str(d2 / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({rec!r}).encode())
        print("held", flush=True)
        time.sleep(120)
    """)
    p = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        acquire(str(d2))
        assert "is stale (that process is gone" in capsys.readouterr().err
        assert read_holder(str(d2))["pid"] == os.getpid()
        release(str(d2))
    finally:
        p.kill()
        p.wait()


def test_the_lock_is_reentrant_in_a_process_and_workers_do_not_need_it(tmp_path):
    from specopd.runs.lock import RunLockedError, acquire, release
    from specopd.train.worker import Worker

    out = tmp_path / "run"
    acquire(str(out))
    acquire(str(out))  # the main job locks its folder, then its training stage locks it again
    release(str(out))
    holder_probe = "from specopd.runs.lock import acquire; import sys; acquire(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", holder_probe, str(out)], capture_output=True, text=True, env=_env())
    assert r.returncode != 0 and "RunLockedError" in r.stderr and f"pid {os.getpid()}" in r.stderr
    release(str(out))
    r = subprocess.run([sys.executable, "-c", holder_probe, str(out)], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr
    # a worker (what a Ray actor builds) runs while another process holds the run folder's lock
    holder = _holder(out)
    try:
        w = Worker(_cfg(out))
        assert w.train_ids
        with pytest.raises(RunLockedError, match=f"pid {holder.pid}"):
            train(_cfg(out), progress=False)
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------------------------- verified reads
def test_a_deleted_manifest_is_damage_and_resume_falls_back(run, tmp_path, capsys):
    out = _copy(run, tmp_path / "run")
    newest = os.path.join(out, "checkpoints", f"step-{STEPS}")
    os.remove(os.path.join(newest, ck.MANIFEST))
    assert "manifest.json is missing, but the COMPLETE marker records its sha256" in ck.verify(newest)
    train(_cfg(out, "trainer.save_every=2", "trainer.keep_last=3"), progress=False)
    text = capsys.readouterr().out
    assert f"moved it aside to {newest}.damaged" in text and "step-2" in text
    straight = load_state(ck.find_latest(run))
    assert all(torch.equal(a, b) for a, b in zip(straight.values(), load_state(ck.find_latest(out)).values()))


def load_state(step_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(step_dir, "model.safetensors"))


def test_export_and_eval_refuse_a_damaged_step_naming_the_newest_good_one(run, tmp_path, capsys):
    out = _copy(run, tmp_path / "run")
    newest, good = (os.path.join(out, "checkpoints", f"step-{s}") for s in (STEPS, 2))
    _poison_fc(newest)  # an inf in fc.weight: same size, other sha256
    rc, so, err = _specopd("export", out, tmp_path / "exp")
    _refused(rc, so, err, f"checkpoint {newest} is damaged", "model.safetensors does not match its sha256",
             f"newest checkpoint of the run that verifies is {good}")
    assert not os.path.exists(tmp_path / "exp")
    rc, so, err = run_cli(capsys, "eval", RECIPE, *_args(out), "eval.prompts=1", "eval.max_new_tokens=2", "--no-baseline")
    _refused(rc, so, err, f"checkpoint {newest} is damaged", f"eval.checkpoint={good}")
    f = os.path.join(newest, "model.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)  # a truncated step: named, no SafetensorError traceback
    rc, so, err = run_cli(capsys, "export", newest, tmp_path / "exp")
    _refused(rc, so, err, "(truncated or overwritten)", good)
    rc, so, err = run_cli(capsys, "eval", RECIPE, *_args(out), f"eval.checkpoint={newest}", "eval.prompts=1",
                        "eval.max_new_tokens=2", "--no-baseline")
    _refused(rc, so, err, f"checkpoint {newest} is damaged", "truncated")
    assert run_cli(capsys, "export", good, tmp_path / "exp")[0] == 0


def test_init_from_and_released_folders_are_verified(run, tmp_path):
    from specopd.drafters import load_drafter
    from specopd.errors import DamagedFolderError
    from specopd.models import load_target

    out = _copy(run, tmp_path / "run")
    newest = os.path.join(out, "checkpoints", f"step-{STEPS}")
    _poison_fc(newest)
    with pytest.raises(DamagedFolderError, match="drafter.init_from .* is damaged: model.safetensors does not match"):
        train(_cfg(tmp_path / "other", f"drafter.init_from={newest}"), progress=False)
    assert not os.path.exists(tmp_path / "other")  # refused before anything is written
    rel = tmp_path / "released"
    assert main(["export", os.path.join(out, "checkpoints", "step-2"), str(rel)]) == 0
    f = rel / "model.safetensors"
    os.truncate(f, os.path.getsize(f) - 7)  # no manifest to check against: the reader names the file
    target = load_target(os.path.join(out, "tiny-target-llama"))
    with pytest.raises(DamagedFolderError, match=f"{f} is not a readable safetensors file"):
        load_drafter(str(rel), target)


# ---------------------------------------------------------------------------------------------- changed inputs
def _prepared(path, n, order=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    recs = [{"input_ids": torch.randint(0, 256, (20,), generator=g).tolist(), "prompt_len": 4} for _ in range(n)]
    recs = [recs[i] for i in order] if order is not None else recs
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def test_resume_refuses_changed_data_and_a_changed_target(tmp_path, monkeypatch):
    import specopd.train.inputs as inputs

    data = tmp_path / "d.jsonl"
    _prepared(data, 64)
    out = tmp_path / "run"
    prep = ["data.source=prepared", f"data.path={data}"]
    train(_cfg(out, *prep, "trainer.max_steps=2"), progress=False)
    st = ck.read_state(ck.find_latest(str(out)))
    assert st["inputs"]["data"]["records"] == 64 and "model.safetensors" in st["inputs"]["target"]["files"]
    recipe_before = open(out / "recipe.yaml").read()
    _prepared(data, 40, order=list(reversed(range(40))))  # rewritten: 40 of its 64 records, reordered
    with pytest.raises(RecipeChangeError, match=r"the data .*d.jsonl changed since the checkpoint \(40 records now, "
                                                r"64 then"):
        train(_cfg(out, *prep, "trainer.max_steps=3"), progress=False)
    assert open(out / "recipe.yaml").read() == recipe_before  # nothing written for a refused resume
    _prepared(data, 64, order=list(reversed(range(64))))  # the same records in another order
    with pytest.raises(RecipeChangeError, match="the same 64 records, other content or order"):
        train(_cfg(out, *prep, "trainer.max_steps=3"), progress=False)
    _prepared(data, 64)  # restored (new mtime): the cache re-hashes it and the resume continues
    calls = []
    real = inputs.sha256_file
    monkeypatch.setattr(inputs, "sha256_file", lambda p: calls.append(p) or real(p))
    train(_cfg(out, *prep, "trainer.max_steps=3"), progress=False)
    assert ck.find_latest(str(out)).endswith("step-3")
    assert calls == []  # the target's files were hashed before and have not changed: read from the cache
    # the tiny target's weights overwritten in place
    w = out / "tiny-target-llama" / "model.safetensors"
    b = bytearray(open(w, "rb").read())
    b[-4:] = b"\x00\x00\x80\x7f"
    open(w, "wb").write(bytes(b))
    with pytest.raises(RecipeChangeError, match=r"the target in .*tiny-target-llama changed since the checkpoint: "
                                                r"model.safetensors \(other content\)"):
        train(_cfg(out, *prep, "trainer.max_steps=4"), progress=False)
    rc = main(["train", RECIPE, *_args(out, *prep, "trainer.max_steps=4")])
    assert rc == 1  # as a refused recipe change


def test_a_refused_resume_writes_nothing(run, tmp_path, capsys):
    """drafter.mask_token_id=3 makes another drafter (no learned mask vector): the resume is refused when the
    checkpoint is loaded, and recipe.yaml, metrics and checkpoints stay as they were."""
    out = _copy(run, tmp_path / "run")
    before = {n: open(os.path.join(out, n), "rb").read() for n in ("recipe.yaml", "metrics.jsonl")}
    ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
    rc = main(["train", RECIPE, *_args(out, "drafter.mask_token_id=3", f"trainer.max_steps={STEPS + 2}",
                                       "trainer.save_every=2", "trainer.keep_last=3")])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot resume" in err
    assert {n: open(os.path.join(out, n), "rb").read() for n in before} == before
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ckpts and not os.path.isdir(
        os.path.join(out, "recipe.history"))


# ---------------------------------------------------------------------------------------------- reproducible bytes
def test_the_same_run_gives_byte_identical_checkpoints(tmp_path):
    out = tmp_path / "run"
    shas = []
    for k in range(2):
        train(_cfg(out, "trainer.max_steps=2"), progress=False)
        d = ck.find_latest(str(out))
        shas.append({n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
                     for n in sorted(os.listdir(d))})
        os.rename(out, tmp_path / f"run-{k}")
    assert shas[0] == shas[1]
    assert set(shas[0]) == {"COMPLETE", "config.json", "manifest.json", "model.safetensors", "state.json",
                            "trainer_state.pt"}


def test_safetensors_headers_are_written_in_a_fixed_order(tmp_path):
    from safetensors.torch import load_file

    from specopd.drafters.layout import save_safetensors

    t = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(2, dtype=torch.bfloat16), "c": torch.tensor(3)}
    blobs = set()
    for i in range(6):
        meta = {"format": "pt", "kind": "dflash", "z": "1", "m": str(i % 1)}
        if i % 2:
            meta = dict(reversed(list(meta.items())))
        save_safetensors(t, str(tmp_path / f"{i}.safetensors"), metadata=meta)
        blobs.add(open(tmp_path / f"{i}.safetensors", "rb").read())
    assert len(blobs) == 1
    back = load_file(str(tmp_path / "0.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in t.items())
    n = int.from_bytes(next(iter(blobs))[:8], "little")
    head = json.loads(next(iter(blobs))[8:8 + n])
    assert list(head["__metadata__"]) == ["format", "kind", "m", "z"]


# ---------------------------------------------------------------------------------------------- messages
def test_interrupt_before_the_first_step_claims_no_checkpoint(tmp_path, monkeypatch, capsys):
    from specopd.train import phases

    def stop(worker, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(phases, "colocated_step", stop)
    rc = main(["train", RECIPE, *_args(tmp_path / "run")])
    o = capsys.readouterr()
    assert rc == 130 and "before its first step: no checkpoint written" in o.out
    assert "written to" not in o.out and "checkpoint of the completed steps was written" not in o.err
    assert not os.path.isdir(tmp_path / "run" / "checkpoints")


def test_an_al_over_no_branches_is_shown_as_a_dash(tmp_path, capsys):
    from specopd.train.validator import format_al

    assert format_al({"expected_al": 1.0, "branches": 0}) == "-" and format_al(None) == "-"
    assert format_al({"expected_al": 1.25, "branches": 3}) == "1.2500"
    train(tiny_recipe(str(tmp_path / "run"), ["data.heldout=0", "trainer.max_steps=1"]), progress=False)
    text = capsys.readouterr().out
    assert "before - -> after - (no held-out sequence" in text and "1.0000 -> 1.0000" not in text


def test_export_into_a_used_folder_needs_force_and_writes_0644(run, tmp_path):
    step = ck.find_latest(run)
    dst = tmp_path / "served"
    dst.mkdir()
    (dst / "config.json").write_text('{"mine": 1}')
    (dst / "notes.txt").write_text("keep me")
    rc, so, err = _specopd("export", step, dst)
    _refused(rc, so, err, f"'{dst}' already holds", "--force")
    assert (dst / "config.json").read_text() == '{"mine": 1}'
    old = os.umask(0o077)
    try:
        assert main(["export", step, str(dst), "--force"]) == 0
    finally:
        os.umask(old)
    assert (dst / "notes.txt").read_text() == "keep me" and "mine" not in (dst / "config.json").read_text()
    for n in ("config.json", "model.safetensors"):
        assert os.stat(dst / n).st_mode & 0o777 == 0o644


def _data(tmp_path, lines, name="d.jsonl", raw=None):
    p = tmp_path / name
    if raw is not None:
        p.write_bytes(raw)
    else:
        p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


_GOOD = {"input_ids": list(range(10, 30)), "prompt_len": 4}


def _cases(tmp_path, run):
    """(name, argv, needles) of mistakes a user can make; each must end in exit 2 naming the cause."""
    n = [0]

    def o():  # a fresh trainer.output_dir per case (they run in parallel; each would hold its lock)
        n[0] += 1
        return tmp_path / f"out{n[0]}"

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    p = lambda d: ["data.source=prepared", f"data.path={d}"]  # noqa: E731
    bad_str = _data(tmp_path, [_GOOD, {"input_ids": [1, "7", 3], "prompt_len": 1}], "str.jsonl")
    bad_neg = _data(tmp_path, [_GOOD, _GOOD, {"input_ids": [5, -2, 9, 9, 9], "prompt_len": 1}], "neg.jsonl")
    bad_float = _data(tmp_path, [{"input_ids": [5, 3.7, 9, 9, 9], "prompt_len": 1}], "float.jsonl")
    bad_utf8 = _data(tmp_path, None, "latin1.jsonl", raw=json.dumps(_GOOD).encode() + b"\n{\"x\": \"caf\xe9\"}\n")
    held = _data(tmp_path, [dict(_GOOD, split="heldout")] * 6, "held.jsonl")
    recipe_latin1 = tmp_path / "latin1.yaml"
    recipe_latin1.write_bytes(b"seed: 0\n# caf\xe9\n")
    step = ck.find_latest(run)
    return [
        ("output_dir is a file", ["train", RECIPE, *_args(a_file)], ["trainer.output_dir=", "it is a file"]),
        ("output_dir under a file", ["train", RECIPE, *_args(a_file / "sub")], ["above it is a file"]),
        ("string token id", ["train", RECIPE, *_args(o(), *p(bad_str))],
         [f"{bad_str}:2: input_ids[1] = \"7\" is not an integer token id"]),
        ("negative token id", ["train", RECIPE, *_args(o(), *p(bad_neg))], [f"{bad_neg}:3: input_ids[1] = -2 is negative"]),
        ("token id 3.7", ["train", RECIPE, *_args(o(), *p(bad_float))], [f"{bad_float}:1: input_ids[1] = 3.7"]),
        ("non-UTF-8 data", ["train", RECIPE, *_args(o(), *p(bad_utf8))], [f"data.path {bad_utf8}:2: not UTF-8"]),
        ("non-UTF-8 recipe", ["train", recipe_latin1, "--dry-run"], [f"recipe {recipe_latin1}:2: not UTF-8"]),
        ("held-out only", ["train", RECIPE, *_args(o(), *p(held))], ["every one of the 6 records", "is held out",
                                                                     "\"split\": \"train\""]),
        ("temperature nan", ["train", RECIPE, "trainer.acceptance_temperature=nan", "--dry-run"],
         ["trainer.acceptance_temperature=nan is not a finite number"]),
        ("lr nan", ["train", RECIPE, "trainer.lr=nan", "--dry-run"], ["trainer.lr=nan is not a finite number"]),
        ("grad_clip nan", ["train", RECIPE, "trainer.grad_clip=nan", "--dry-run"], ["trainer.grad_clip=nan"]),
        ("shape nan", ["train", RECIPE, "model.tiny={rms_norm_eps: .inf}", "--dry-run"],
         ["model.tiny.rms_norm_eps: not a finite number"]),
        ("model.tiny typo", ["train", RECIPE, "model.tiny.hiden_size=32", "--dry-run"],
         ["model.tiny: unknown key(s) ['hiden_size']", "hidden_size"]),
        ("--json is a folder", ["train", RECIPE, *_args(o()), "--json", tmp_path], [f"--json '{tmp_path}'",
                                                                                    "it is a folder"]),
        ("eval --json is a folder", ["eval", RECIPE, *_args(o()), "--json", tmp_path], ["it is a folder"]),
        ("export of a file", ["export", a_file, tmp_path / "e1"], ["is a file, not a folder"]),
        ("export into a file", ["export", step, a_file], [f"export folder '{a_file}'", "it is a file"]),
        ("export under a file", ["export", step, a_file / "x"], ["above it is a file"]),
        ("prepare --out is a file", ["prepare", "data", "--target", tmp_path / "none", "--out", a_file],
         ["prepare data --out=", "it is a file"]),
        ("recipe is a folder", ["train", tmp_path, "--dry-run"], ["is a folder; give a YAML file"]),
    ] + ([] if torch.cuda.is_available() else [
        ("cuda on a CPU machine", ["train", RECIPE, *_args(o()), "model.device=cuda"],
         ["model.device=cuda, but torch sees no CUDA device", "model.device=cpu"]),
        ("eval cuda on a CPU machine", ["eval", RECIPE, *_args(o()), "model.device=cuda"], ["model.device=cuda"]),
    ])


def _nothing_trained(tmp_path):
    for d in os.listdir(tmp_path):
        if d.startswith("out"):  # refused before any training: no recipe, no checkpoint
            assert not {"recipe.yaml", "checkpoints", "metrics.jsonl"} & set(os.listdir(tmp_path / d)), d


def test_every_user_mistake_is_a_clear_message_with_exit_2_in_process(run, tmp_path, capsys):
    """The cases of the subprocess test below through ``main()`` in this process (fast: no interpreter start per
    case): an exception escaping ``main`` would fail the test, as a traceback would."""
    for name, argv, needles in _cases(tmp_path, run):
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2, (name, rc, err[-3000:])
        for n in needles:
            assert n in err, (name, n, err[-3000:])
    _nothing_trained(tmp_path)


@pytest.mark.slow
def test_every_user_mistake_is_a_clear_message_with_exit_2(run, tmp_path):
    """Each case through the CLI in a subprocess (two at a time): exit 2, the cause named, no traceback; nothing
    trained or written into trainer.output_dir."""
    from concurrent.futures import ThreadPoolExecutor

    cases = _cases(tmp_path, run)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: _specopd(*c[1]), cases))
    for (name, _, needles), (rc, so, err) in zip(cases, results):
        assert rc == 2 and "Traceback" not in err, (name, rc, err[-3000:])
        for n in needles:
            assert n in err, (name, n, err[-3000:])
    _nothing_trained(tmp_path)


def test_internal_bugs_still_show_a_traceback(tmp_path, monkeypatch):
    """A bug (an exception that is not a user's mistake) is not dressed up as one: it leaves ``main`` (Python
    prints its traceback), while a user's mistake of the same run is a message."""
    import specopd.train.validator as validator

    def bug(*a, **k):
        raise KeyError("an internal bug")

    monkeypatch.setattr(validator, "evaluate_heldout", bug)
    monkeypatch.delenv("SPECOPD_DEBUG", raising=False)
    with pytest.raises(KeyError, match="an internal bug"):
        main(["train", RECIPE, *_args(tmp_path / "run", "trainer.eval_heldout=true")])
    with pytest.raises(AttributeError):  # an internal AttributeError is not a user's mistake either
        monkeypatch.setattr(validator, "evaluate_heldout", lambda *a, **k: None.missing)
        main(["train", RECIPE, *_args(tmp_path / "run2", "trainer.eval_heldout=true")])
