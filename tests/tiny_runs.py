"""The smallest useful training runs, for tests (seconds on one CPU core): ``TINY_TEST_OVERRIDES``,
``tiny_recipe`` (a validated tiny recipe writing to a folder) and ``run_cli`` (the CLI in-process)."""
from __future__ import annotations

from specopd.config import load_recipe

TINY_TEST_OVERRIDES = [
    "data.num_samples=24", "data.prompt_len=4", "data.seq_len=20", "data.batch_size=4", "data.heldout=0.25",
    "drafter.block_size=4", "trainer.anchors_per_seq=4", "trainer.eval_anchors_per_seq=4", "trainer.max_steps=4",
    "trainer.lr_warmup_steps=1", "trainer.save_every=0", "profile.enabled=false",
]


def tiny_recipe(output_dir: str, overrides=(), target: str = "tiny:llama"):
    """A validated tiny RecipeConfig writing to ``output_dir`` (``overrides``: extra a.b=c strings)."""
    return load_recipe(None, TINY_TEST_OVERRIDES + [f"model.target={target}", f"trainer.output_dir={output_dir}"]
                       + list(overrides))


def run_cli(capsys, *argv) -> tuple:
    """``specopd.cli.main(argv)`` in this process: (exit code, stdout, stderr) of that call alone."""
    from specopd.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    o = capsys.readouterr()
    return rc, o.out, o.err
