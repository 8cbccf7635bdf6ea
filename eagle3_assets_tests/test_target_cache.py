"""The GGUF conversion parses a file once (`_gguf_parsed_once`) and leaves the gguf package as it was."""

import gguf
import numpy as np

from eagle3_assets.core.target import _gguf_parsed_once


def test_gguf_reader_memoized_inside_the_conversion_only(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    with _gguf_parsed_once():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is second  # parsed once, whichever form the path takes
        assert first.fields["llama.block_count"].contents() == 2
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)  # outside the block: the library's own
