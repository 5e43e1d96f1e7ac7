//! Generated tokens to released text: what a stream may send so far, and where a stop string
//! ends the output. Streamed pieces always add up to the final text, so a streamed response and
//! a non-streamed one for the same tokens carry the same text.

/// Follows the decoded text of the tokens committed so far.
pub struct TextTracker {
    stop: Vec<String>,
    /// Text already released to the client (a prefix of every later decoding).
    released: String,
    /// The text up to the first stop string, once one appeared.
    stopped_at: Option<String>,
}

impl TextTracker {
    pub fn new(stop: Vec<String>) -> Self {
        TextTracker {
            stop,
            released: String::new(),
            stopped_at: None,
        }
    }

    /// Whether a stop string has appeared (generation should end).
    pub fn stopped(&self) -> bool {
        self.stopped_at.is_some()
    }

    /// Takes the decoding of every token so far; returns the text that may be released now.
    /// Held back: a trailing U+FFFD (a character whose bytes are still to come) and a tail that
    /// could be the start of a stop string.
    pub fn update(&mut self, text: &str) -> Option<String> {
        if self.stopped() {
            return None;
        }
        if let Some(cut) = self.first_stop(text) {
            // The output ends before the stop string; release what is left of it.
            let end = floor_char_boundary(text, cut.max(self.released.len()));
            self.stopped_at = Some(text[..end].to_string());
            return self.release_up_to(&text[..end]);
        }
        let mut safe = text.trim_end_matches(char::REPLACEMENT_CHARACTER).len();
        safe -= self.stop_prefix_len(&text[..safe]);
        self.release_up_to(&text[..safe])
    }

    /// The final text given the decoding of every generated token, and the piece of it not yet
    /// released.
    pub fn finish(&mut self, text: &str) -> (String, Option<String>) {
        let full = match &self.stopped_at {
            Some(cut) => cut.clone(),
            None => match self.first_stop(text) {
                Some(cut) => {
                    text[..floor_char_boundary(text, cut.max(self.released.len()))].to_string()
                }
                None => text.to_string(),
            },
        };
        let rest = self.release_up_to(&full);
        (full, rest)
    }

    fn release_up_to(&mut self, text: &str) -> Option<String> {
        // Detokenization can rewrite earlier text in rare cases (a merge across the boundary);
        // what was sent cannot be taken back, so release only extensions of it.
        let new = text.strip_prefix(self.released.as_str())?;
        if new.is_empty() {
            return None;
        }
        let new = new.to_string();
        self.released.push_str(&new);
        Some(new)
    }

    /// Byte offset of the earliest stop string in `text`.
    fn first_stop(&self, text: &str) -> Option<usize> {
        self.stop.iter().filter_map(|s| text.find(s.as_str())).min()
    }

    /// Length of the longest tail of `text` that is a proper prefix of a stop string.
    fn stop_prefix_len(&self, text: &str) -> usize {
        let mut longest = 0;
        for stop in &self.stop {
            for (end, _) in stop.char_indices().skip(1) {
                if end > longest && text.ends_with(&stop[..end]) {
                    longest = end;
                }
            }
        }
        longest
    }
}

fn floor_char_boundary(text: &str, mut index: usize) -> usize {
    index = index.min(text.len());
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds growing decodings and returns the released pieces and the final text.
    fn run(stop: &[&str], decodings: &[&str]) -> (Vec<String>, String) {
        let mut tracker = TextTracker::new(stop.iter().map(|s| s.to_string()).collect());
        let mut pieces = Vec::new();
        for d in decodings {
            pieces.extend(tracker.update(d));
            if tracker.stopped() {
                break;
            }
        }
        let (full, rest) = tracker.finish(decodings.last().unwrap());
        pieces.extend(rest);
        assert_eq!(pieces.concat(), full, "pieces add up to the final text");
        (pieces, full)
    }

    #[test]
    fn text_streams_as_it_grows() {
        let (pieces, full) = run(&[], &["a", "ab", "abc"]);
        assert_eq!(pieces, ["a", "b", "c"]);
        assert_eq!(full, "abc");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_even_across_tokens() {
        let (pieces, full) = run(&["END"], &["x", "xE", "xEN", "xEND", "xENDmore"]);
        assert_eq!(full, "x");
        assert_eq!(pieces, ["x"]);
        let (_, full) = run(&["\n\n", "!"], &["hi", "hi!", "hi!!"]);
        assert_eq!(full, "hi");
    }

    #[test]
    fn a_possible_stop_prefix_is_released_when_it_turns_out_not_to_be_one() {
        let (pieces, full) = run(&["ab"], &["a", "ac"]);
        assert_eq!(pieces, ["ac"]);
        assert_eq!(full, "ac");
    }

    #[test]
    fn an_incomplete_character_is_held_back() {
        let (pieces, full) = run(&[], &["é\u{FFFD}", "éa"]);
        assert_eq!(pieces, ["é", "a"]);
        assert_eq!(full, "éa");
    }
}
