//! `otlp_span`: see `tollgate_gateway::fuzz::otlp_span`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tollgate_gateway::fuzz::otlp_span(data));
