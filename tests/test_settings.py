"""The server's and the client's settings (lynx_hf/transfer/settings.py): frozen, one validator each, a bad value one
ConfigError naming the setting when the settings are built; keywords over the settings; renamed keywords named."""
import dataclasses

import pytest

from lynx_hf.errors import ConfigError
from lynx_hf.transfer.settings import ClientSettings, ServerSettings, with_fields


@pytest.mark.parametrize("kw, says", [
    ({"bandwidth_bps": 0.0}, "bandwidth_bps"), ({"latency_s": -1.0}, "latency_s"),
    ({"prefix_cache_mb": -1.0}, "prefix_cache_mb"), ({"max_inflight_mb": 1e12}, "this machine's memory"),
    ({"idle_timeout_s": 1e9}, "idle_timeout_s must be at most"), ({"prefill_step": 0}, "prefill_step"),
    ({"max_concurrent_prefills": True}, "max_concurrent_prefills"), ({"port": 70000}, "port"),
    ({"data_plane": "rdma"}, "data_plane must be one of"), ({"tls_key": "k.pem"}, "TLS key without a certificate"),
])
def test_a_bad_server_setting_is_refused_when_built(kw, says):
    with pytest.raises(ConfigError, match=says):
        ServerSettings(**kw)


@pytest.mark.parametrize("kw, says", [
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": True}, "timeout_s"), ({"data_plane": "x"}, "data_plane"),
    ({"prefill_on": "gpu"}, "prefill_on must be one of auto, prefill, decode"), ({"link_bps": -5.0}, "link_bps"),
])
def test_a_bad_client_setting_is_refused_when_built(kw, says):
    with pytest.raises(ConfigError, match=says):
        ClientSettings(**kw)


def test_keywords_apply_over_the_settings_and_unknown_or_renamed_ones_are_named():
    base = ServerSettings(bandwidth_bps=15e6, prefill_step=512)
    s = with_fields(ServerSettings, base, {"prefill_step": 256}, "PrefillServer")
    assert (s.bandwidth_bps, s.prefill_step) == (15e6, 256) and base.prefill_step == 512
    assert with_fields(ServerSettings, None, {}, "PrefillServer") == ServerSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1
    with pytest.raises(TypeError, match="'prefill_chunk' is now 'prefill_step'"):
        with_fields(ServerSettings, None, {"prefill_chunk": 8}, "PrefillServer")
    with pytest.raises(TypeError, match="unexpected keyword argument 'bandwith_bps'"):
        with_fields(ServerSettings, None, {"bandwith_bps": 8}, "PrefillServer")
    with pytest.raises(TypeError, match="settings must be a ClientSettings"):
        with_fields(ClientSettings, ServerSettings(), {}, "DecodeClient")
    with pytest.raises(ConfigError, match="timeout_s"):  # the validator runs on the replaced settings too
        with_fields(ClientSettings, ClientSettings(), {"timeout_s": -1}, "DecodeClient")
