"""Redis ACL rules name the run's keys through ``common.keys`` (one place for key strings)."""
from __future__ import annotations

import pytest

from common import redis_acl, security
from common.keys import Keys

pytestmark = pytest.mark.timeout(10)


def test_every_users_rules_reach_this_runs_keys_only():
    prefix = Keys("r-1").prefix
    assert prefix == "ddl:{r-1}:"
    assert security.redis_acl_rules("r-1") == f"~{prefix}* +@all -@dangerous -@admin"
    assert redis_acl.reader_rules("r-1").startswith(f"resetkeys resetchannels %R~{prefix}* -@all +get ")
    assert f"%R~{prefix}* ~{prefix}learner:a " in redis_acl.learner_rules("r-1", "a")
    assert redis_acl.role_rules("r-1") == security.redis_acl_rules("r-1")
    assert "ddl:{other}" not in redis_acl.reader_rules("r-1") + redis_acl.learner_rules("r-1", "a")
