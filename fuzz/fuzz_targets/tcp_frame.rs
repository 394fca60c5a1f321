//! The TCP collectives' frames: the bytes as a peer's connection, read frame by frame as a
//! rank's reader thread reads it (`next_frame`: the header, then the body in parts as it
//! arrives), each message's length checked as a receive checks it (`unexpected`). Anything may
//! be refused; no input may panic, hang, overflow, or allocate what it does not carry (a header
//! may claim 2^61 elements).
#![no_main]

use engine::parallel::tcp::{Frame, next_frame, unexpected};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut stream = data;
    let mut claimed = 0;
    while let Ok(frame) = next_frame(&mut stream, |lane, len| {
        let _ = unexpected(1, lane, len, 20544);
        claimed = len;
    }) {
        if let Frame::Data { body, .. } = frame {
            assert_eq!(body.len() as u64, claimed);
        }
    }
});
