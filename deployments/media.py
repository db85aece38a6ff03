"""The MediaPreprocessor deployment: a CPU pool for fetching and preparing images and video.

A pass-through until vision lands (--vision fails at startup, so no media reaches it yet): it
returns parts unchanged, keeping the graph's final shape and resource plan.
"""

from __future__ import annotations

from typing import Any

from ray import serve


@serve.deployment(name="MediaPreprocessor", num_replicas=2, ray_actor_options={"num_cpus": 0.1})
class MediaPreprocessorDeployment:
    def prepare(self, parts: list[Any]) -> list[Any]:
        return parts
