"""Share spec: parsing from every entry point, and refusals that name field, value and range."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jupyter_gpushare.inventory import TypeAliases, check_spec, simulated_gpus
from jupyter_gpushare.share import (
    MEMORY_UNIT,
    SHARE_FIELDS,
    SHOWN_CHARS,
    GpuLabels,
    ShareError,
    ShareSpec,
    format_bytes,
    parse_memory,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10GiB", 10 * 2**30),
        ("512Mi", 512 * 2**20),
        ("2G", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("1048576", 2**20),
        (2**20, 2**20),
        (" 3 MiB ", 3 * 2**20),
        ("1.0000001MiB", 2**20),
        ("1024TiB", 2**50),
    ],
)
def test_memory_sizes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "10 parsecs",
        "-1GiB",
        "0",
        "GiB",
        True,
        1.5,
        None,
        [1],
        "4096",
        1024,
        "0.0000001",
        "9" * 400 + "GiB",
        pytest.param(10**5000, id="5001-digits"),
        1e300,
        "１０GiB",
        "١٠GiB",
        "10GiB\n",
        "1025TiB",
        float("nan"),
        float("inf"),
    ],
)
def test_bad_memory_names_field_and_units(bad):
    with pytest.raises(ShareError) as err:
        parse_memory(bad)
    assert err.value.field == "gpu_memory"
    assert "gpu_memory=" in str(err.value)


@pytest.mark.parametrize(
    ("data", "field", "allowed"),
    [
        ({"gpu_request": 0.7, "gpu_limit": 0.5}, "gpu_request", "at most gpu_limit (0.5)"),
        ({"gpu_request": -0.1}, "gpu_request", "(0, 1]"),
        ({"gpu_request": math.nan}, "gpu_request", "(0, 1]"),
        ({"gpu_limit": 1.5}, "gpu_limit", "(0, 1]"),
        ({"gpu_request": "lots"}, "gpu_request", "(0, 1]"),
        ({"gpu_count": 2.5}, "gpu_count", "whole number"),
        ({"gpu_count": 2, "gpu_request": 0.5}, "gpu_request", "gpu_count=2"),
        ({"gpu_limt": 0.5}, "gpu_limt", "known keys"),
        (
            {"gpu_labels": {"affinity": "a", "anti_affinity": "a"}},
            "gpu_labels.anti_affinity",
            "other than the affinity",
        ),
        ({"gpu_labels": {"team": "x"}}, "gpu_labels.team", "keys are"),
        ({"gpu_type": "A100; drop"}, "gpu_type", "GPU type name"),
    ],
)
def test_refusals_name_field_value_and_range(data, field, allowed):
    with pytest.raises(ShareError) as err:
        ShareSpec.from_mapping(data)
    assert err.value.field == field
    assert allowed in err.value.allowed
    body = err.value.to_json()
    assert body["field"] == field and body["error"] == "invalid_share"


def test_defaults_layer_and_cli_flags():
    base = ShareSpec.from_mapping({"gpu_request": 0.25, "gpu_limit": 0.5, "gpu_type": "A100"})
    spec = ShareSpec.from_args(request="0.75", memory="10GiB", defaults=base)
    assert (spec.gpu_request, spec.gpu_limit) == (0.75, 0.75)  # the request lifts the limit
    assert spec.gpu_memory == 10 * 2**30 and spec.gpu_type == "A100"
    whole = ShareSpec.from_mapping({"gpu_count": 2})
    assert (whole.gpu_request, whole.gpu_limit, whole.gpu_count) == (1.0, 1.0, 2)
    labels = GpuLabels.parse("affinity=team-a,exclusive=exam")
    assert labels.to_json() == {"affinity": "team-a", "exclusive": "exam"}


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True))
def test_any_pair_is_either_valid_or_refused(request, limit):
    try:
        spec = ShareSpec.from_mapping({"gpu_request": request, "gpu_limit": limit})
    except ShareError as err:
        assert err.field in ("gpu_request", "gpu_limit")
    else:
        assert 0 < spec.gpu_request <= spec.gpu_limit <= 1


def test_check_against_inventory():
    gpus = simulated_gpus("1xA100,2xT4", node="n1")
    aliases = TypeAliases()
    assert check_spec(ShareSpec(gpu_type="a100"), gpus, aliases).gpu_type == "A100"
    with pytest.raises(ShareError, match="one of A100, T4"):
        check_spec(ShareSpec(gpu_type="H100"), gpus, aliases)
    with pytest.raises(ShareError) as err:
        check_spec(ShareSpec(gpu_type="T4", gpu_memory=16 * 2**30), gpus, aliases)
    assert err.value.field == "gpu_memory" and "at most 15GiB" in err.value.allowed
    with pytest.raises(ShareError, match="at most 2"):
        check_spec(ShareSpec.from_mapping({"gpu_count": 3, "gpu_type": "T4"}), gpus, aliases)


def test_type_aliases_match_whole_tokens():
    aliases = TypeAliases()
    assert aliases.alias_for("NVIDIA A100-SXM4-80GB") == "A100"
    assert aliases.alias_for("NVIDIA-A100-SXM4-80GB") == "A100"  # node label form
    assert aliases.alias_for("NVIDIA A10") == "A10"
    assert aliases.alias_for("Tesla T4") == "T4"
    assert aliases.alias_for("NVIDIA H100 80GB HBM3") == "H100"
    assert aliases.alias_for("Some Future GPU") == "Some Future GPU"
    custom = TypeAliases({"big": ["H100", "H200"]})
    assert custom.alias_for("NVIDIA H200") == "big"


def test_format_bytes():
    assert format_bytes(10 * 2**30) == "10GiB"
    assert format_bytes(3 * 2**29) == "1.5GiB"
    assert format_bytes(12) == "12B"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.25, 0.25),
        ("0.3", 0.3),
        (".5", 0.5),
        ("5e-1", 0.5),
        (1, 1.0),
        ("0.01", 0.01),
        (0.1 + 0.2, 0.3),
    ],
)
def test_compute_shares_are_steps_of_the_unit(value, expected):
    assert ShareSpec.from_mapping({"gpu_request": value, "gpu_limit": 1}).gpu_request == expected


@pytest.mark.parametrize(
    "bad",
    [
        1e-320,
        "1e-320",
        0.005,
        0.333,
        "0.333",
        10**400,
        -(10**400),
        "9" * 5000,
        "٠٫٥",
        "٠.٥",
        "０.５",
        "1_0",
        "nan",
        "Infinity",
        "-0",
        0,
        True,
        False,
        "0.5\n",
        "",
        " ",
        ".",
        "e5",
        [0.5],
        {"x": 1},
        None.__class__,
    ],
)
def test_meaningless_or_foreign_numbers_are_refused_with_the_unit(bad):
    with pytest.raises(ShareError) as err:
        ShareSpec.from_mapping({"gpu_request": bad})
    assert err.value.field == "gpu_request"
    assert "steps of 0.01" in err.value.allowed and "smallest share is 0.01" in err.value.allowed
    body = err.value.to_json()
    json.dumps(body)  # always writable, whatever the value was
    assert len(str(body["value"])) <= SHOWN_CHARS + 2


@pytest.mark.parametrize("bad", [10**400, 2.5, "x2", "٢", True, "1e400", float("inf"), 17, 0])
def test_gpu_count_refuses_huge_foreign_and_fractional_counts(bad):
    with pytest.raises(ShareError) as err:
        ShareSpec.from_mapping({"gpu_count": bad, "gpu_request": 1, "gpu_limit": 1})
    assert err.value.field == "gpu_count" and "whole number of GPUs" in err.value.allowed


def test_huge_values_are_shown_cut_short():
    with pytest.raises(ShareError) as err:
        parse_memory("9" * 5000 + "GiB")
    assert len(str(err.value)) < 300 and "ASCII digits" in err.value.allowed
    with pytest.raises(ShareError) as err:
        parse_memory(10**5000)
    assert "about 5001 digits" in str(err.value)
    deep: object = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ShareError) as err:
        ShareSpec.from_mapping({"gpu_request": deep})
    assert err.value.to_json()["value"] == "[… 1 item(s)]"
    with pytest.raises(ShareError) as err:
        ShareSpec.from_mapping(deep)  # type: ignore[arg-type]
    assert err.value.field == "share"


def test_memory_unit_is_stated():
    with pytest.raises(ShareError) as err:
        parse_memory("0.0000001")
    assert err.value.allowed.startswith("at least 1MiB")
    assert parse_memory("1MiB") == MEMORY_UNIT


@pytest.mark.parametrize(
    ("text", "parses"),
    [
        ("0.25", True),
        ("0.3-0.6", True),
        (".5", True),
        ("1", True),
        ("0.01", True),
        ("0.3 - 0.6", True),
        ("0.333", False),
        ("0.005", False),
        ("٠.٥", False),
        ("1e-3", False),
    ],
)
def test_hub_form_pattern_agrees_with_the_parser(text, parses):
    """The Hub form checks a custom share in the browser (share.SHARE_PATTERN) before the server
    parses it (share_from_text, then ShareSpec): both take the same texts."""
    import re

    from jupyter_gpushare.share import SHARE_PATTERN, share_from_text, share_text

    try:
        spec = ShareSpec.from_mapping(share_from_text(text))
        parsed = True
        assert ShareSpec.from_mapping(share_from_text(share_text(spec))) == spec
    except ShareError:
        parsed = False
    assert parsed == parses
    assert bool(re.match(SHARE_PATTERN, text)) == parses


@given(
    st.from_regex(r"\A[ \t]?[0-9]{1,4}(\.[0-9]{1,2})?[ \t]?[a-zA-Z]{0,3}[ \t]?\Z")
    | st.text(max_size=8)
)
def test_hub_memory_pattern_agrees_with_parse_memory(text):
    """The Hub form's memory pattern (share.MEMORY_PATTERN) takes exactly the texts whose
    syntax parse_memory takes (any unit it knows, in any case); the size itself (1MiB up) is
    checked on the server."""
    import re

    from jupyter_gpushare.share import MEMORY_PATTERN

    try:
        parse_memory(text)
        syntax = True
    except ShareError as err:
        syntax = not err.allowed.startswith("a size in bytes or with a unit")
    assert bool(re.fullmatch(MEMORY_PATTERN, text)) == syntax, text  # JS: $ is the end


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300)
    | st.floats()
    | st.text(max_size=20)
    | st.text(st.characters(categories=["Nd"]), max_size=5)
    | st.builds(str, st.floats())
    | st.sampled_from(["10GiB", "0.25", "1e-320", "A100"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(st.dictionaries(st.sampled_from([*SHARE_FIELDS, "gpu_limt"]), _JSON, max_size=4) | _JSON)
def test_any_input_is_a_valid_share_or_one_clear_refusal(data):
    """Whatever a caller sends (REST JSON, kernelspec config): a share inside the units, or a
    ShareError with a short message and a JSON body; never another exception."""
    try:
        spec = ShareSpec.from_mapping(data)
    except ShareError as err:
        body = err.to_json()
        json.dumps(body)
        assert body["field"] and body["allowed"] and len(body["message"]) < 600
    else:
        assert 0 < spec.gpu_request <= spec.gpu_limit <= 1
        assert round(spec.gpu_request * 100) == pytest.approx(spec.gpu_request * 100)
        assert spec.gpu_memory is None or MEMORY_UNIT <= spec.gpu_memory <= 2**50
