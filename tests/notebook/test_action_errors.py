"""The kernel side's refusals are the package's one error model (jupyter_gpushare.errors): the
magics and the panel catch ``actions.GpushareError``, which is that base, and every refusal the
kernel side raises (no share, no daemon, the daemon's refusal, a bad value) is one of them, with
the same code, message and JSON as the server's."""

from __future__ import annotations

import pytest

from jupyter_gpushare import errors
from jupyter_gpushare.daemon import client as daemon_client
from jupyter_gpushare.notebook import actions
from jupyter_gpushare.share import ShareError


def test_one_base() -> None:
    assert actions.GpushareError is errors.GpushareError
    assert issubclass(actions.NoShare, errors.GpushareError)
    # still the daemon client's error (and an OSError) for code that catches that
    assert issubclass(actions.DaemonUnreachable, daemon_client.DaemonUnreachable)
    assert issubclass(actions.DaemonUnreachable, OSError)


def test_refusals_keep_their_words_and_codes(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in ("GPUSHARE_ALLOCATION_ID", "GPUSHARE_SOCKET", "GPUSHARE_LEDGER"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(actions.NoShare) as none:
        actions.gpus()
    assert none.value.code == "no_share" and none.value.status == 409
    assert none.value.to_json() == {
        "error": "no_share",
        "message": "This kernel was not started with a GPU share (GPUSHARE_SOCKET is not set): "
        "pick a 'GPU share' kernel.",
    }
    monkeypatch.setenv("GPUSHARE_SOCKET", str(tmp_path / "nobody.sock"))
    with pytest.raises(actions.DaemonUnreachable) as gone:
        actions.gpus()
    assert gone.value.code == "daemon" and str(gone.value).startswith(
        "The gpushare daemon is unreachable: "
    )
    refused = actions._refused(
        {"ok": False, "error": "no_fit", "message": "no A100 has 0.5 free", "suggestions": ["x"]}
    )
    assert isinstance(refused, errors.GpushareError)
    assert refused.to_json() == {
        "error": "no_fit",
        "message": "no A100 has 0.5 free (x)",
        "suggestions": ["x"],
    }


def test_a_bad_value_is_a_share_error_the_magics_catch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_ALLOCATION_ID", "a-0123456789abcdef")
    monkeypatch.setenv("GPUSHARE_SOCKET", "/nonexistent/gpushare.sock")
    with pytest.raises(actions.GpushareError) as bad:
        actions.request(gpu_request="lots")
    assert isinstance(bad.value, ShareError) and bad.value.code == "invalid_share"
    assert bad.value.field == "gpu_request" and bad.value.value == "lots"
