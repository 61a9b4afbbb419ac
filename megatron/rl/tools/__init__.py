"""Tool calling: parsing a model's tool calls out of its generated text (``parsers``)."""
