"""`moekit.compare`: outputs computed elsewhere against the reference, `moekit check`'s report."""

import numpy as np
import pytest

import moekit
from conftest import PARAMS, inputs_of, make_layer

LAYER = make_layer(np.float32, seed=2)


@pytest.mark.parametrize("kernel", ["router_topk", "permute", "blockwise_mm", "blockwise_mm_bwd"])
def test_the_cpu_backends_outputs_pass(kernel):
    inputs = inputs_of(kernel, LAYER)
    outputs = moekit.run(kernel, backend="cpu", **inputs, **PARAMS[kernel])
    report = moekit.compare(kernel, inputs, outputs, **PARAMS[kernel])
    assert report.passed and bool(report)
    assert [row["tensor"] for row in report.rows] == list(outputs)
    assert "PASS" in str(report) and kernel in str(report)
    for row in report.rows:
        assert row["failures"] == 0 and row["max_abs"] <= 1e-5


def test_a_wrong_output_fails_and_says_where():
    inputs = inputs_of("blockwise_mm", LAYER)
    outputs = moekit.run("blockwise_mm", backend="reference", **inputs)
    output = outputs["output"].copy()
    output[3, 5] += 0.5
    output[7, 1] += 0.5
    report = moekit.compare("blockwise_mm", inputs, {"output": output}, rtol=1e-3, atol=1e-3)
    assert not report.passed
    (row,) = report.rows
    assert row["tensor"] == "output" and row["failures"] == 2
    assert row["max_abs"] == pytest.approx(0.5, rel=1e-3)
    assert "FAIL (2 of" in str(report)
    # The same output within a loose enough tolerance passes.
    assert moekit.compare("blockwise_mm", inputs, {"output": output}, rtol=0, atol=1.0).passed


def test_indices_must_be_equal():
    inputs = inputs_of("router_topk", LAYER)
    outputs = moekit.run("router_topk", backend="reference", **inputs, k=2)
    index = outputs["expert_index"].copy()
    index[0] = index[0, ::-1]
    report = moekit.compare("router_topk", inputs, {"expert_index": index}, k=2, atol=1.0)
    assert report.rows[0]["failures"] == 2


def test_bf16_outputs_are_compared_against_the_float32_reference():
    import ml_dtypes

    inputs = inputs_of("router_topk", LAYER)
    outputs = moekit.run("router_topk", backend="reference", **inputs, k=2, output_dtype="float32")
    rounded = outputs["topk_affinities"].astype(ml_dtypes.bfloat16)
    report = moekit.compare("router_topk", inputs, {"topk_affinities": rounded}, k=2,
                            rtol=2**-8, atol=0)
    assert report.passed
    assert 0 < report.rows[0]["max_rel"] <= 2**-8


def test_outputs_that_the_kernel_does_not_have_are_errors():
    inputs = inputs_of("router_topk", LAYER)
    with pytest.raises(moekit.ContractError, match=r"tensor `logits`: is not an output of `router_topk`"):
        moekit.compare("router_topk", inputs, {"logits": inputs["x"]}, k=2)
    with pytest.raises(moekit.ContractError, match=r"param `outputs`: none given"):
        moekit.compare("router_topk", inputs, {}, k=2)
