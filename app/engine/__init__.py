"""The engine: typed work in, typed results out; one core owns the device. No FastAPI, no pydantic."""
