"""The model the real engine runs: a Llama-family decoder, its config and weight loading."""
