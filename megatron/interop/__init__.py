"""Hugging Face interop: our checkpoints to and from GPT2LMHeadModel, BertForPreTraining and
MegatronBertForPreTraining, one key mapping per architecture, shared by export and import."""
