"""Cluster table and custom cluster files."""

from __future__ import annotations

import json

import pytest

from densetrain.planner.hardware import BUILTIN_CLUSTERS, get_cluster, load_cluster_file


def test_builtin_table_has_the_data_sheet_entries():
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "tpu-v4"} <= set(BUILTIN_CLUSTERS)
    assert get_cluster("h100").peak_flops == 989e12
    assert get_cluster("A100").memory_bytes == 80e9
    assert get_cluster("tpu-v4").peak_flops == 275e12
    with pytest.raises(ValueError, match="unknown cluster 'b300'"):
        get_cluster("b300")


def test_custom_clusters_from_toml_and_json(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("""
[clusters.mygpu]
peak_tflops = 500
memory_gb = 96
hbm_tb_s = 3.0
devices_per_node = 4
intra_node_gb_s = 200
inter_node_gb_s = 12.5
gemm_efficiency = 0.7
gemm_half_dim = 96
attention_efficiency = 0.4
collective_efficiency = 0.9
collective_half_mb = 8
""")
    custom = load_cluster_file(toml)
    gpu = get_cluster("mygpu", custom)
    assert gpu.peak_flops == 500e12 and gpu.devices_per_node == 4
    assert gpu.collective_efficiency == 0.9 and gpu.collective_half_bytes == 8 * 2**20
    assert gpu.inter_node_bytes_per_s == 12.5e9
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"clusters": {"x": {"peak_tflops": 1, "memory_gb": 1,
                                                 "hbm_tb_s": 1, "devices_per_node": 1,
                                                 "intra_node_gb_s": 1, "inter_node_gb_s": 1,
                                                 "gemm_efficiency": 1, "gemm_half_dim": 1,
                                                 "attention_efficiency": 1}}}))
    plain = load_cluster_file(js)["x"]
    assert plain.memory_bytes == 1e9
    # Without the optional collective fields every payload runs at the link's bandwidth.
    assert plain.collective_efficiency == 1.0 and plain.collective_half_bytes == 0.0


_EFF = "gemm_efficiency = 0.8\ngemm_half_dim = 128\nattention_efficiency = 0.4\n"


@pytest.mark.parametrize("body, message", [
    ("[clusters.g]\npeak_tflops = 1\n", "missing required fields"),
    ("[clusters.g]\npeak_tflop = 1\n", "unknown fields \\['peak_tflop'\\]"),
    ("[clusters.g]\npeak_tflops = -1\nmemory_gb = 1\nhbm_tb_s = 1\ndevices_per_node = 1\n"
     "intra_node_gb_s = 1\ninter_node_gb_s = 1\n" + _EFF, "peak_flops must be > 0"),
    ("[clusters.g]\npeak_tflops = 1\nmemory_gb = 1\nhbm_tb_s = 1\ndevices_per_node = 1\n"
     "intra_node_gb_s = 1\ninter_node_gb_s = 1\n", "missing required fields \\['gemm_efficiency'"),
    ("[clusters.g]\npeak_tflops = 1\nmemory_gb = 1\nhbm_tb_s = 1\ndevices_per_node = 1\n"
     "intra_node_gb_s = 1\ninter_node_gb_s = 0\n" + _EFF, "inter_node_bytes_per_s must be > 0"),
    ("[clusters.g]\npeak_tflops = 1\nmemory_gb = 1\nhbm_tb_s = 1\ndevices_per_node = 1\n"
     "intra_node_gb_s = 1\ninter_node_gb_s = 1\ngemm_efficiency = 0\ngemm_half_dim = 1\n"
     "attention_efficiency = 0.5\n", "gemm_efficiency must be > 0"),
    ("[clusters.g]\npeak_tflops = 1\nmemory_gb = 1\nhbm_tb_s = 1\ndevices_per_node = 1\n"
     "intra_node_gb_s = 1\ninter_node_gb_s = 1\n" + _EFF + "collective_efficiency = 1.5\n",
     "collective_efficiency must be in \\(0, 1\\]"),
    ("[clusters.g]\npeak_tflops = 1\nmemory_gb = 1\nhbm_tb_s = 1\ndevices_per_node = 1\n"
     "intra_node_gb_s = 1\ninter_node_gb_s = 1\n" + _EFF + "collective_half_mb = -1\n",
     "collective_half_bytes must be >= 0"),
    ("x = 1\n", "expected a non-empty \\[clusters.<name>\\] table"),
])
def test_bad_cluster_files_name_file_and_field(tmp_path, body, message):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message) as e:
        load_cluster_file(path)
    assert str(path) in str(e.value)
