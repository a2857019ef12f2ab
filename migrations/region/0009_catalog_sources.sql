-- Deployments stored before sources existed got their slug as the repository (0008), but a
-- catalog slug is not a Hugging Face repository id: the model server must load the catalog
-- model's repository (catalog/catalog.json as of this migration).
UPDATE model_deployments SET source_repository = CASE lower(model_slug)
        WHEN 'mistral/mistral-7b-instruct-v3' THEN 'mistralai/Mistral-7B-Instruct-v0.3'
        WHEN 'meta-llama/llama-3.1-8b-instruct' THEN 'meta-llama/Llama-3.1-8B-Instruct'
        WHEN 'meta-llama/llama-3.3-70b-instruct' THEN 'meta-llama/Llama-3.3-70B-Instruct'
        WHEN 'qwen/qwen2.5-7b-instruct' THEN 'Qwen/Qwen2.5-7B-Instruct'
        WHEN 'deepseek-ai/deepseek-r1-distill-llama-70b' THEN 'deepseek-ai/DeepSeek-R1-Distill-Llama-70B'
        WHEN 'openai/gpt-oss-20b' THEN 'openai/gpt-oss-20b'
        ELSE source_repository
    END
WHERE NOT source_custom AND source_repository = model_slug;
