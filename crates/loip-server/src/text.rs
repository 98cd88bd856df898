//! The text of generated tokens as a client sees it: decoded incrementally, cut before the
//! first stop string, and streamed without ever sending text that a stop string could still
//! take back.

use loip_model::tokenizer::{StreamDecoder, Tokenizer};

/// Text of generated tokens as it becomes final: the same pieces as `loip generate` prints
/// (`[id]` without a tokenizer), cut before the first stop string, holding back a tail that
/// could still become one.
pub(crate) struct TextStream<'t> {
    decoder: Option<StreamDecoder<'t>>,
    stops: &'t [String],
    text: String,
    sent: usize, // bytes of `text` already emitted
}

impl<'t> TextStream<'t> {
    pub(crate) fn new(tok: Option<&'t Tokenizer>, stops: &'t [String]) -> Self {
        TextStream {
            decoder: tok.map(StreamDecoder::new),
            stops,
            text: String::new(),
            sent: 0,
        }
    }

    /// Adds a token; returns the newly final text and whether a stop string appeared.
    pub(crate) fn push(&mut self, id: u32) -> (String, bool) {
        let piece = match &mut self.decoder {
            Some(d) => d.push(id).ok().flatten().unwrap_or_default(),
            None => format!("[{id}]"),
        };
        self.text.push_str(&piece);
        if self.cut_at_stop() {
            return (self.take(self.text.len()), true);
        }
        let hold = held_back(&self.text, self.stops);
        (self.take(self.text.len() - hold), false)
    }

    /// The remaining text and the whole text.
    pub(crate) fn finish(mut self) -> (String, String) {
        if let Some(d) = self.decoder.take() {
            if let Ok(rest) = d.finish() {
                self.text.push_str(&rest);
            }
        }
        self.cut_at_stop();
        let rest = self.take(self.text.len());
        (rest, self.text)
    }

    /// Truncates the text before the first stop string; whether there was one.
    fn cut_at_stop(&mut self) -> bool {
        let cut = self.stops.iter().filter_map(|s| self.text.find(s)).min();
        if let Some(cut) = cut {
            self.text.truncate(cut.max(self.sent));
        }
        cut.is_some()
    }

    fn take(&mut self, upto: usize) -> String {
        let upto = upto.max(self.sent);
        let out = self
            .text
            .get(self.sent..upto)
            .unwrap_or_default()
            .to_string();
        self.sent = upto;
        out
    }
}

/// Bytes at the end of `text` that begin some stop string (and may yet complete it).
fn held_back(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .filter_map(|s| {
            (1..s.len())
                .rev()
                .find(|&k| s.get(..k).is_some_and(|p| text.ends_with(p)))
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_are_cut_and_their_prefixes_held_back() {
        let stops = vec!["</s>".to_string(), "ab".to_string()];
        let mut t = TextStream::new(None, &stops);
        t.text = "hello <".into();
        assert_eq!(held_back(&t.text, &stops), 1);
        assert_eq!(t.take(t.text.len() - 1), "hello ");
        t.text.push_str("/s> more");
        assert!(t.cut_at_stop());
        assert_eq!(t.take(t.text.len()), "");
        assert_eq!(t.finish(), (String::new(), "hello ".to_string()));
        assert_eq!(held_back("xa", &stops), 1);
        assert_eq!(held_back("xé", &["éa".to_string()]), 2);
        assert_eq!(held_back("x", &[]), 0);
    }

    #[test]
    fn token_ids_without_a_tokenizer_print_as_ids() {
        let stops = vec!["[7]".to_string()];
        let mut t = TextStream::new(None, &stops);
        assert_eq!(t.push(5), ("[5]".to_string(), false));
        assert_eq!(t.push(7), (String::new(), true));
        assert_eq!(t.finish().1, "[5]");
    }
}
