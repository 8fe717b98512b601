"""Exit codes of every ``ddloco`` command and daemon (docs/commands.md lists them for users)."""
OK = 0
FAILURE = 1   # a runtime failure: lost Redis, a crashed daemon, a run that did not reach its end
USAGE = 2     # bad usage or config: one line names the problem; nothing was started
REFUSED = 3   # refused by the run (a learner whose model, task or key does not match it)
DID_NOT_TRAIN = 4  # `ddloco up` only: every process ended well but the run did not train as it should
