"""What it takes to run the hosts' own training steps on a CPU, in one place (the tests' helper, not the package).

Every shim here names the host's (or megatron-core's) file and line it works around and the version it was written
against. Nothing here changes what the hosts compute: devices, process-group backends and stubbed imports only.
Modules: ``slime`` (slime @624b824a's ``train_one_step`` on gloo processes); other hosts' modules sit beside it.
"""
