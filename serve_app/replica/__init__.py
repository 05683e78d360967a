"""The engine replica (EngineServer), its health, its adapters' board."""
