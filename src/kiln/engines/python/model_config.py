"""``pb_utils.ModelConfig``: the object a Triton Python model's ``auto_complete_config`` receives and returns.

It wraps the model configuration as a dict (Triton's JSON form, ``TYPE_*`` names for data types). A model may read
it with ``as_dict()`` and fill in what config.pbtxt leaves out: ``add_input``, ``add_output``,
``set_max_batch_size``, ``set_dynamic_batching`` and ``set_model_transaction_policy``. Conflicting values raise
ValueError, as in Triton, and the model then fails to load with that message.
"""

from __future__ import annotations

import json
from typing import Any

_INPUT_KEYS = ("name", "data_type", "dims", "optional")
_OUTPUT_KEYS = ("name", "data_type", "dims")
_POLICY_KEYS = ("decoupled",)


class ModelConfig:
    def __init__(self, model_config: str | dict[str, Any]) -> None:
        doc = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._model_config: dict[str, Any] = doc
        doc.setdefault("input", [])
        doc.setdefault("output", [])
        doc.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._model_config["max_batch_size"])
        if current > max_batch_size:
            raise ValueError(f"model '{self._name}': the configuration sets max_batch_size {current}, but "
                             f"auto_complete_config sets {max_batch_size}; it may only raise it")
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(f"model '{self._name}': the configuration chooses {other}, so "
                                 f"auto_complete_config cannot set dynamic_batching")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add_tensor("input", input, _INPUT_KEYS)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add_tensor("output", output, _OUTPUT_KEYS)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        unknown = [key for key in transaction_policy_dict if key not in _POLICY_KEYS]
        if unknown:
            raise ValueError(f"model '{self._name}': model_transaction_policy key '{unknown[0]}' is not supported; "
                             f"expected only 'decoupled'")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(f"model '{self._name}': the configuration sets decoupled: "
                                 f"{str(policy['decoupled']).lower()}; auto_complete_config cannot change it")
            policy["decoupled"] = wanted

    def _add_tensor(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        name = tensor.get("name")
        unknown = [key for key in tensor if key not in allowed]
        if unknown:
            raise ValueError(f"model '{self._name}': {kind} '{name}' has the property '{unknown[0]}'; "
                             f"auto_complete_config may set only {', '.join(allowed)}")
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"model '{self._name}': {kind} '{name}' from auto_complete_config has no '{key}'")
        entry = {**tensor, "dims": [int(d) for d in tensor["dims"]]}
        for current in self._model_config[kind]:
            if current.get("name") == name:
                self._merge(kind, current, entry)
                return
        self._model_config[kind].append(entry)

    def _merge(self, kind: str, current: dict[str, Any], entry: dict[str, Any]) -> None:
        name = entry["name"]
        declared_type = current.get("data_type", "TYPE_INVALID")
        if declared_type not in ("TYPE_INVALID", entry["data_type"]):
            raise ValueError(f"model '{self._name}': {kind} '{name}' is {declared_type} in the configuration, but "
                             f"auto_complete_config says {entry['data_type']}")
        declared_dims = [int(d) for d in current.get("dims", [])]
        if declared_dims and declared_dims != entry["dims"]:
            raise ValueError(f"model '{self._name}': {kind} '{name}' has dims {declared_dims} in the configuration, "
                             f"but auto_complete_config says {entry['dims']}")
        if "optional" in current and "optional" in entry and bool(current["optional"]) != bool(entry["optional"]):
            raise ValueError(f"model '{self._name}': {kind} '{name}' has optional: "
                             f"{str(current['optional']).lower()} in the configuration, but auto_complete_config "
                             f"says {str(entry['optional']).lower()}")
        current.update(entry)
