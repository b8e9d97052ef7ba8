"""Document masking: packed documents are computed exactly as if each were alone."""

import torch

from ember.models.llama import LlamaArgs, Transformer
from ember.nn.attention import causal_attention, document_causal_mask, document_layout

EOS = 1


def test_document_layout_restarts_positions_after_each_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4],
                           [EOS, 3, 3, 3, 3, 3, 3, 3]])
    ids, positions = document_layout(tokens, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]
    mask = document_causal_mask(ids)
    assert mask.shape == (2, 1, 8, 8)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]


def test_without_documents_it_is_plain_causal_attention():
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    one_doc = torch.zeros(2, 6, dtype=torch.long)
    torch.testing.assert_close(causal_attention(q, k, v, one_doc), causal_attention(q, k, v))


def test_packed_documents_match_each_document_alone():
    torch.manual_seed(0)
    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=64, multiple_of=16,
                     rope_theta=10000.0)
    model = Transformer(args)
    model.init_weights()
    model.eval()
    doc_a = torch.randint(2, 50, (7,)).tolist() + [EOS]
    doc_b = torch.randint(2, 50, (9,)).tolist() + [EOS]
    doc_c = torch.randint(2, 50, (5,)).tolist()
    packed = torch.tensor([doc_a + doc_b + doc_c])
    ids, positions = document_layout(packed, EOS)
    with torch.no_grad():
        out = model(packed, positions, ids)[0]  # (T, V)
        plain = model(packed)[0]
        alone = [model(torch.tensor([d]))[0] for d in (doc_a, doc_b, doc_c)]
    torch.testing.assert_close(out[:8], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[8:18], alone[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[18:], alone[2], rtol=1e-5, atol=1e-5)
    assert (plain[8:] - out[8:]).abs().max() > 1e-3  # without the mask, later documents see earlier ones
