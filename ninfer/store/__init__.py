"""Stored Responses: the LRU ResponseStore and the clients the router reaches it through."""

from ninfer.store.client import LocalResponseStore, RayResponseStore, ResponseStoreClient
from ninfer.store.response_store import Continuation, NewResponse, PutResult, ResponseStore

__all__ = ["Continuation", "LocalResponseStore", "NewResponse", "PutResult", "RayResponseStore", "ResponseStore",
           "ResponseStoreClient"]
