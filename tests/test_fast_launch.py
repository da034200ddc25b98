"""kernels/fast_launch.py: the specialisation key and the direct path's argument list (CPU), and
on a GPU the renorms through direct launches give Triton's launches' bytes."""

import pytest
import torch

from tpguard.kernels import fast_launch as fl


def test_key_separates_what_triton_specialises_on():
    a = torch.zeros(64)
    assert fl._spec(a) == fl._spec(torch.ones(64))  # values do not matter
    assert fl._spec(a) != fl._spec(a[1:])  # 16-byte alignment does
    assert fl._spec(a) != fl._spec(a.double())
    assert fl._spec(1) != fl._spec(2) != fl._spec(16)  # == 1, % 16
    assert fl._spec(3) == fl._spec(5)
    assert fl._spec(2**31 + 1) != fl._spec(3)
    assert fl._spec(2**40 + 1) != fl._spec(2**31 + 1)  # width classes
    assert fl._spec(True) != fl._spec(1)  # bools are not ints here
    assert fl._spec(0.5) == fl._spec(2.0)
    with pytest.raises(TypeError):
        fl._spec("text")  # outside the key: the caller takes Triton's launch


def test_direct_list_puts_grid_stream_and_arguments_in_place(monkeypatch):
    monkeypatch.setattr(fl, "_current_stream", lambda: 77)
    x, y = torch.zeros(4), torch.zeros(4)
    recorded = [3, 1, 1, 5, "fn", ("meta",), None, None, None, x, 10, 0.5, 8]  # 3 args + 1 constexpr
    entry = fl._Entry(run=print, template=list(recorded), n_args=3)
    assert entry.template[9:12] == [None] * 3  # the first call's tensors are not kept
    built = entry.build((6, 2), (y, 11, 0.25))
    assert built == [6, 2, 1, 77, "fn", ("meta",), None, None, None, y, 11, 0.25, 8]
    assert fl._matches(entry.build((3,), (x, 10, 0.5)), recorded[:3] + [77] + recorded[4:])
    # another tensor object, another value or another length: not the same call
    assert not fl._matches(entry.build((3,), (y, 10, 0.5)), recorded[:3] + [77] + recorded[4:])
    assert not fl._matches(entry.build((3,), (x, 10.0, 0.5)), recorded[:3] + [77] + recorded[4:])
    assert not fl._matches(entry.build((3,), (x, 10, 0.5)), recorded[:3] + [77] + recorded[4:] + [1])


def test_interpreter_and_switch_off_take_tritons_launch():
    # under TRITON_INTERPRET=1 (the CI) the direct path is off: nothing is cached
    from tpguard.kernels.fingerprint import fast_launch_enabled

    if not fast_launch_enabled():
        assert fl.state() == {"direct": 0, "pending": 0, "refused": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches exist on a GPU only")
def test_renorms_through_direct_launches_equal_tritons():
    from tpguard.kernels import fingerprint as kfp
    from tpguard.kernels import renorm

    calls = {
        "top_p": lambda x: renorm.top_p_renorm(x, 0.9),
        "top_k": lambda x: renorm.top_k_renorm(x, 40),
        "top_k_top_p": lambda x: renorm.top_k_top_p_renorm(x, 40, torch.full((x.shape[0],), 0.9, device=x.device)),
        "min_p": lambda x: renorm.min_p_renorm(x, 0.1),
    }
    for rows, vocab in ((1, 163840), (8, 32000), (64, 2048), (3, 100)):
        g = torch.Generator(device="cuda").manual_seed(rows)
        for scale in (1.0, 5.0):
            x = torch.softmax(torch.randn(rows, vocab, device="cuda", generator=g) * scale, -1)
            for name, fn in calls.items():
                kfp.FAST_LAUNCH = False
                want = fn(x)
                kfp.FAST_LAUNCH = True
                got = [fn(x) for _ in range(4)]  # Triton, recorded, checked, then direct
                for y in got:
                    assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (name, rows, vocab)
        # an option whose tensor argument goes by keyword (bracket_bins' bmass_ptr): Triton's launch, same bytes
        from tpguard.kernels.renorm_passes import DEFAULT_CONFIG
        from tpguard.kernels.renorm_top_p import top_p_renorm_triton

        cfg = DEFAULT_CONFIG.replace(bracket_bins=16)
        assert torch.equal(top_p_renorm_triton(x, 0.9, config=cfg).view(torch.int32),
                           renorm.top_p_renorm(x, 0.9).view(torch.int32))
    kfp.FAST_LAUNCH = True
    st = fl.state()
    assert st["direct"] > 0 and st["refused"] == 0, (st, kfp.FAST_LAUNCH_FAILURES)
