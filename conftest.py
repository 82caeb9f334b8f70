"""Settings every test process needs before torch loads (pytest imports this file first, for tests/ and
functional_tests/ alike; spawned workers inherit the environment).

MKL_CBWR=COMPATIBLE: torch's CPU build evaluates exp / log through MKL's vector math, which picks a code path by the
CPU it runs on (AVX-512 and AVX2 machines give results one ulp apart). The golden suites hold NeMo-RL's float32
values bit for bit, so the tests fix MKL's conditional-numerical-reproducibility mode to the one path every x86 CPU
runs the same way. MKL reads it at its first call, hence here, before anything imports torch. A value set by the
caller is kept.
"""

import os

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
