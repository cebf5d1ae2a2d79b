"""The calls room: how a model is talked to and read. Its chat format and template quirks, the tool
calls in each model's own format (`formats/`, one module each), its thoughts, the grammars that hold a
call or an answer to its schema, the calls closed near a reply's limit, and the prompt's token ids."""
