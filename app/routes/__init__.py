"""HTTP routes: thin functions that parse, call the engine and map the result."""
