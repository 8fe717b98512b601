"""Flags made from the config dataclasses (common/flags.py) and the overrides they give (common/command.py)."""
from __future__ import annotations

import dataclasses

import pytest

from common.command import override_by_flags
from common.config import AlgoConfig, ConfigError, LearnerOptions, SyncerOptions
from common.flags import ALGO_FLAGS, Flag, field_doc

pytestmark = pytest.mark.timeout(30)


def _learner_args(*argv: str):
    from learner.cli import build_parser
    return build_parser().parse_args(list(argv))


def test_a_flag_made_from_a_field_says_the_fields_docstring_and_default():
    text = Flag("--sync-every", AlgoConfig, "sync_every_steps").help()
    assert text.startswith("H: each fragment is merged about once every H learner steps"), text
    assert text.endswith("(default 12)") and "[ours" not in text, text   # the provenance note is the docs'
    assert "``" not in field_doc(SyncerOptions, "metrics_port")


def test_a_percent_in_a_docstring_is_escaped_for_argparse():
    assert "70 %%" in Flag("--group-sharding", LearnerOptions, "group_sharding").help()


def test_a_flag_left_out_keeps_the_files_value_and_a_zero_given_is_a_value():
    from learner.cli import FLAGS
    from_file = LearnerOptions(max_steps=5, threads=2)
    assert override_by_flags(_learner_args(), from_file, FLAGS) == from_file
    opts = override_by_flags(_learner_args("--steps", "0", "--slowdown", "1.5"), from_file, FLAGS)
    assert (opts.max_steps, opts.slowdown, opts.threads) == (0, 1.5, 2)


def test_a_switch_sets_its_value_only_when_given():
    from syncer.cli import FLAGS, build_parser
    assert override_by_flags(build_parser().parse_args(["--fresh"]), SyncerOptions(), FLAGS).fresh is True
    assert override_by_flags(build_parser().parse_args([]), SyncerOptions(), FLAGS).fresh is False
    args = build_parser().parse_args(["--no-grace", "--lockstep"])
    algo = override_by_flags(args, AlgoConfig(), ALGO_FLAGS)
    assert (algo.grace_enabled, algo.lockstep) == (False, True)


@pytest.mark.parametrize("argv, line", [
    (["--threads", "0"], "--threads must be >= 1"),
    ([], "learner.threads must be >= 1"),      # not set by a flag (a file, the code): named by its field
])
def test_an_out_of_range_value_is_named_where_the_user_gave_it(argv, line):
    from learner.cli import FLAGS
    base = dataclasses.replace(LearnerOptions(), threads=1)
    with pytest.raises(ConfigError) as e:
        override_by_flags(_learner_args(*argv), base, FLAGS, **({} if argv else {"threads": 0}))
    assert str(e.value) == line


def test_every_generated_flag_names_a_field_with_a_docstring():
    from ddloco.cli import UP_FLAGS, UP_LEARNER_FLAGS
    from learner.cli import FLAGS as LEARNER_FLAGS
    from syncer.cli import FLAGS as SYNCER_FLAGS
    for f in (*ALGO_FLAGS, *UP_FLAGS, *UP_LEARNER_FLAGS, *LEARNER_FLAGS, *SYNCER_FLAGS):
        assert f.field in {x.name for x in dataclasses.fields(f.owner)}, f
        assert field_doc(f.owner, f.field), f"{f.flag}: {f.owner.__name__}.{f.field} has no docstring"
