"""Tool-call formats, one module per model family; grpoflow.chat.tool_calls registers them by name."""
