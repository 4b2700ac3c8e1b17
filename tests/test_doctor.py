"""The doctor's advice for known-bad combinations of variables."""
from mgpu_lab.runtime.doctor import advice

IFACES = ["lo", "eth0"]


def test_clean_environment_needs_no_advice():
    assert advice({}, gpus=0, interfaces=IFACES) == []


def test_known_bad_combinations_are_flagged():
    cases = {
        "CUDA_VISIBLE_DEVICES": ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        "RANK and WORLD_SIZE": ({"RANK": "0"}, 0),
        "MASTER_ADDR and MASTER_PORT": ({"MASTER_ADDR": "10.0.0.1"}, 0),
        "no effect on the gloo": ({"NCCL_DEBUG": "INFO"}, 0),
        "InfiniBand is off": ({"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"}, 1),
        "NVLink": ({"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO"}, 1),
        "matches no network interface": ({"NCCL_SOCKET_IFNAME": "ib0", "NCCL_DEBUG": "WARN"}, 1),
        "NCCL_DEBUG=INFO": ({}, 2),
    }
    for expected, (environ, gpus) in cases.items():
        tips = advice(environ, gpus=gpus, interfaces=IFACES)
        assert any(expected in tip for tip in tips), (expected, tips)


def test_interface_prefixes_and_exclusions_are_understood():
    assert advice({"GLOO_SOCKET_IFNAME": "eth"}, 0, IFACES) == []  # a prefix of eth0
    assert advice({"GLOO_SOCKET_IFNAME": "=eth0"}, 0, IFACES) == []
    assert advice({"GLOO_SOCKET_IFNAME": "^docker"}, 0, IFACES) == []
    assert advice({"GLOO_SOCKET_IFNAME": "=eth"}, 0, IFACES) != []
