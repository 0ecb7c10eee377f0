// The microphone's samples, resampled to 16 kHz in the page and sent to the main thread in blocks of
// 100 ms. Resampling: a low-pass windowed-sinc filter (cutoff at 0.9 of 8 kHz) at the input rate, then
// linear interpolation at the output instants; at 16 kHz the samples pass through.
const OUT_RATE = 16000;
const BLOCK = 1600; // 100 ms at 16 kHz

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ratio = sampleRate / OUT_RATE; // input samples per output sample
    this.taps = this.ratio > 1 ? lowPass(0.9 * 0.5 / this.ratio, 2 * Math.ceil(8 * this.ratio) + 1) : null;
    this.history = new Float32Array(this.taps ? this.taps.length - 1 : 0); // the filter's last inputs
    this.filtered = []; // filtered input samples not yet interpolated
    this.position = 0; // the next output instant, in input samples from filtered[0]
    this.block = new Float32Array(BLOCK);
    this.filled = 0;
    this.port.onmessage = (e) => { if (e.data === "flush") this.flush(true); };
  }

  process(inputs) {
    const input = inputs[0];
    if (input && input.length) {
      const mono = new Float32Array(input[0].length);
      for (const channel of input) for (let i = 0; i < mono.length; i++) mono[i] += channel[i] / input.length;
      this.take(mono);
    }
    return true;
  }

  take(samples) {
    if (!this.taps) { for (const s of samples) this.emit(s); return; }
    const all = new Float32Array(this.history.length + samples.length);
    all.set(this.history);
    all.set(samples, this.history.length);
    const n = this.taps.length;
    for (let i = 0; i + n <= all.length; i++) {
      let acc = 0;
      for (let k = 0; k < n; k++) acc += this.taps[k] * all[i + k];
      this.filtered.push(acc);
    }
    this.history = all.slice(all.length - (n - 1));
    while (this.position + 1 < this.filtered.length) {
      const i = Math.floor(this.position), frac = this.position - i;
      this.emit(this.filtered[i] * (1 - frac) + this.filtered[i + 1] * frac);
      this.position += this.ratio;
    }
    const used = Math.floor(this.position);
    this.filtered = this.filtered.slice(used);
    this.position -= used;
  }

  emit(sample) {
    this.block[this.filled++] = sample;
    if (this.filled === BLOCK) this.flush();
  }

  flush(last = false) {
    if (this.filled) this.port.postMessage(this.block.slice(0, this.filled));
    this.filled = 0;
    if (last) this.port.postMessage("flushed");
  }
}

function lowPass(cutoff, length) { // cutoff in cycles per input sample; a Hann-windowed sinc of unit gain
  const taps = new Float32Array(length), mid = (length - 1) / 2;
  let sum = 0;
  for (let i = 0; i < length; i++) {
    const t = i - mid;
    const sinc = t === 0 ? 2 * cutoff : Math.sin(2 * Math.PI * cutoff * t) / (Math.PI * t);
    taps[i] = sinc * (0.5 - 0.5 * Math.cos(2 * Math.PI * i / (length - 1)));
    sum += taps[i];
  }
  for (let i = 0; i < length; i++) taps[i] /= sum;
  return taps;
}

registerProcessor("capture", Capture);
