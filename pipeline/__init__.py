"""Pretraining pipeline for Eco-RNA, ProtLingo and RecursiveGPT."""
