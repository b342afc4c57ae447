"""Results are keyed by their backend's numerics version: the CUDA backend's FP8/FP4 GEMMs sum in another order
than the reference's (numerics.CUDA_NUMERICS), so a snapshot, prefix-cache entry or link peer of one backend is
refused by the other, while the reference backend keeps NUMERICS_VERSION as it was."""

import dataclasses

import pytest

from dsflash.engine import snapshot
from dsflash.engine.session import engine_identity
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.numerics import NUMERICS_VERSION, numerics_version
from tests.conftest import TEXT_CASE


def test_each_backend_has_its_numerics_version():
    assert numerics_version("reference") == str(NUMERICS_VERSION)
    assert numerics_version("cuda") != numerics_version("reference")
    assert numerics_version("cuda").startswith(f"{NUMERICS_VERSION}.")  # it builds on the shared version
    with pytest.raises(ValueError, match="backend 'tpu'"):
        numerics_version("tpu")


def test_a_snapshot_of_one_backend_is_refused_by_the_other():
    model = load_model(TEXT_CASE)
    cpu_id = engine_identity(model)
    assert cpu_id.endswith(f"-n{NUMERICS_VERSION}")
    model.k = dataclasses.replace(model.k, name="cuda")  # the identity reads only the backend's name
    cuda_id = engine_identity(model)
    assert cuda_id.endswith(f"-n{numerics_version('cuda')}") and cuda_id != cpu_id
    blob = snapshot.encode({"decoder": SequenceState()}, [1, 2, 3], cpu_id, {})
    assert snapshot.check(blob, cpu_id)[0]["tokens"] == 3
    with pytest.raises(snapshot.SnapshotError, match="belongs to model"):
        snapshot.check(blob, cuda_id)
