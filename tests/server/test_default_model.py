"""``make run``'s server: the bundled trained model answers over the OpenAI API, through the official client."""
from __future__ import annotations

from tests.server.conftest import MODEL, ServerProcess


def test_the_bundled_model_answers_a_sum_over_the_api(tmp_path):
    srv = ServerProcess(tmp_path, "--max-model-len", "1024", "--num-cache-blocks", "256")
    try:
        client = srv.client()
        for question in ("What is 48213 + 3771?", "48213+3771="):  # the README's question, the training format
            chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                  max_tokens=8, temperature=0.0)
            assert chat.choices[0].message.content == "51984" and chat.choices[0].finish_reason == "stop"
        done = client.completions.create(model=MODEL, prompt="905-77=", max_tokens=8, temperature=0.0, stop=["\n"])
        assert done.choices[0].text == str(905 - 77)
    finally:
        assert srv.stop() == 0, srv.log()
