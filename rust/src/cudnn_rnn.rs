//! cuDNN's recurrent layers as an estimate sees them. Torch runs `nn.LSTM`, `nn.GRU` and `nn.RNN`
//! on a GPU through one operator, `aten._cudnn_rnn`, which asks cuDNN how much workspace and
//! reserve space the call needs (`cudnnGetRNNTempSpaceSizes`) and allocates both. The reserve
//! follows the sizes, but the workspace depends on the algorithm cuDNN picks for the shapes, so
//! no fake implementation can know it: the estimate refuses, and says how to measure instead.

/// cuDNN's `cudnnRNNMode_t`, the `mode` argument torch passes to `aten._cudnn_rnn`, as the
/// module a person wrote.
pub fn variant(mode: i64) -> &'static str {
    match mode {
        0 => "nn.RNN(nonlinearity='relu')",
        1 => "nn.RNN",
        2 => "nn.LSTM",
        3 => "nn.GRU",
        _ => "a recurrent layer",
    }
}

/// Why an estimate of a step that runs a recurrent layer on cuDNN is refused, and what to do.
pub fn refusal(mode: i64) -> String {
    format!(
        "no estimate was made: {} runs on cuDNN (aten._cudnn_rnn), and cuDNN sizes that call's workspace \
         at run time by the algorithm it picks for the shapes (measured from 8 MiB to over 1 GiB, not a \
         function of the sizes alone), which fake tensors can't know. Nothing was allocated. Measure it \
         instead: run one step inside a GPUExperiment, or gpuexp.find_batch_size(step, estimate=False)",
        variant(mode)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_names_the_module_the_operator_and_the_way_to_measure() {
        let lstm = refusal(2);
        assert!(lstm.contains("nn.LSTM runs on cuDNN (aten._cudnn_rnn)"), "{lstm}");
        assert!(lstm.contains("estimate=False") && lstm.contains("Nothing was allocated"), "{lstm}");
        assert_eq!([variant(0), variant(1), variant(3)], ["nn.RNN(nonlinearity='relu')", "nn.RNN", "nn.GRU"]);
        assert!(refusal(7).contains("a recurrent layer runs on cuDNN"));
    }
}
