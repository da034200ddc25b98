"""The renorm words (tpguard/renorm_words.py: one vocabulary for TPGUARD_RENORM, the harness's
--renorm and the kernels' backend=, and its old spellings) and the registry (tpguard/renorm_registry.py:
what each word picks on CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tpguard import renorm_registry as reg
from tpguard import renorm_words as words
from tpguard.config import GuardConfig


def test_one_vocabulary():
    from tpguard.kernels.renorm_args import BACKENDS

    known = {words.DEFAULT, words.DETERMINISTIC, *reg.NAMES}
    assert set(words.HARNESS_RENORMS) <= known and set(words.PLUGIN_RENORMS) <= set(words.HARNESS_RENORMS)
    assert set(BACKENDS) <= known  # the kernels' backend= is a subset, same meanings
    assert set(words.DETERMINISTIC_ORDER) == {n for n, s in reg.SPECS.items() if s.deterministic}
    assert all(not reg.SPECS[n].deterministic for n in ("flashinfer", "emulated-atomic", "sgl_kernel"))


def test_words_resolve_on_cpu():
    assert reg.resolve("default", "cpu") == "emulated-atomic"
    assert reg.resolve("deterministic", "cpu") == "tpguard"
    assert reg.deterministic_names("cpu") == ["tpguard", "torch"]
    assert reg.pick_deterministic("cpu", "flashinfer-det") == "tpguard"  # not here: the first that runs
    assert reg.pick_deterministic("cpu", "torch") == "torch"
    assert reg.routed_to("default", "cpu") is None and reg.routed_to("deterministic", "cpu") == "tpguard"
    b = reg.get_backend("deterministic", "cpu")
    assert b.name == "tpguard" and b.deterministic and "torch reference on CPU" in b.source
    assert reg.get_backend("default", "cpu").describe() == "emulated-atomic (tpguard.kernels.emulated_atomic)"
    for word, needle in (("flashinfer", "GPUs only"), ("flashinfer-det", "GPUs only"), ("bogus", "unknown")):
        with pytest.raises(reg.BackendUnavailable, match=needle):
            reg.get_backend(word, "cpu")


def test_exact_backends_have_no_stand_ins(monkeypatch):
    # triton imported (its own @triton.jit functions decorated) under the run's TRITON_INTERPRET, not
    # the one set below: decorated without it, they fail this process's interpreted kernels later on
    from tpguard.kernels.renorm_args import triton_available

    triton_available()

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(reg.BackendUnavailable, match="TRITON_INTERPRET"):
        reg.get_backend("tpguard", "cpu", exact=True)
    ref = reg.get_backend("torch", "cpu", exact=True)
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(ref.top_k_top_p(probs, 5, 0.8), ref.top_p(ref.top_k(probs, 5), 0.8))


def test_old_spellings():
    from tpguard.launch.options import parse_options

    assert parse_options(["--renorm", "auto"]).renorm == "default"
    assert parse_options([]).renorm == "default"
    env = {"TPGUARD_RENORM": "deterministic", "TPGUARD_RENORM_BACKEND": "flashinfer"}
    assert GuardConfig.from_env(env).renorm_choice == "flashinfer-det"
    assert GuardConfig.from_env({"TPGUARD_RENORM": "torch"}).renorm_choice == "torch"
    assert GuardConfig.from_env({"TPGUARD_RENORM": "default", "TPGUARD_RENORM_BACKEND": "torch"}).renorm_choice \
        == "default"
    with pytest.raises(ValueError, match="TPGUARD_RENORM must be one of default|deterministic"):
        GuardConfig.from_env({"TPGUARD_RENORM": "flashinfer"})


def test_registry_import_is_light():
    code = ("import sys, tpguard.renorm_registry, tpguard.launch.options\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
