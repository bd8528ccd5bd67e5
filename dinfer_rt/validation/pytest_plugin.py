"""pytest form of the validation suite, for a vendor's own CI:

    pytest --pyargs dinfer_rt.validation --dinfer-backend=NAME [--dinfer-dtypes=float32,bfloat16]

Registered through the ``pytest11`` entry point so the options exist before collection.
"""

from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("dinfer-rt validation")
    group.addoption("--dinfer-backend", default="cpu", help="backend to validate against the float64 reference")
    group.addoption("--dinfer-dtypes", default="float32,bfloat16", help="dtypes for op conformance")


def pytest_generate_tests(metafunc):
    if "op_case" in metafunc.fixturenames:
        from dinfer_rt.dtypes import resolve_dtype
        from dinfer_rt.validation.opdb import cases

        dtypes = [resolve_dtype(d) for d in metafunc.config.getoption("--dinfer-dtypes").split(",") if d]
        params = [(c, d) for c in cases() for d in dtypes]
        metafunc.parametrize("op_case", params, ids=[f"{c.key}/{d}".replace("torch.", "") for c, d in params])
