// Vercel's AI SDK at its defaults (`openai("NAME")`: the Responses API): a forced tool call that runs, then
// `streamText` going on from it with a token limit that cuts the next forced call (#42 item 1). The second call is
// asked twice on the same history: as the rollout's continuing call (OPENAI_BASE_URL) and as a new rollout's first
// call (PLAIN_BASE_URL). Prints, for each, the stream's finish reason and the tool calls the SDK ran or refused.
// Greedy (temperature 0): the Responses provider does not send `seed`.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText, tool } from "ai";
import { z } from "zod";

const ran = [];
const getWeather = tool({
  description: "Current weather of a city",
  inputSchema: z.object({ city: z.enum(["Paris", "Rome"]) }),
  execute: async (input) => {
    ran.push(input);
    return "sunny";
  },
});
const tools = { get_weather: getWeather };
// One call a reply: the first reply's one call and its result are the history.
const forced = {
  tools,
  toolChoice: "required",
  providerOptions: { openai: { parallelToolCalls: false } },
  maxRetries: 0,
  temperature: 0,
};
const prompt = [{ role: "user", content: "What is the weather in Rome and in Paris?" }];

const first = await generateText({
  model: createOpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: "unused" })("my-agent"),
  messages: prompt,
  maxOutputTokens: 160,
  ...forced,
});
if (first.toolCalls.length === 0 || first.toolResults.length !== first.toolCalls.length) {
  console.error(`the first call made no tool call that ran: ${JSON.stringify(first.content)}`);
  process.exit(1);
}
const history = [...prompt, ...first.response.messages, { role: "user", content: "And tomorrow?" }];

async function cut(baseURL) {
  ran.length = 0;
  const result = streamText({
    model: createOpenAI({ baseURL, apiKey: "unused" })("my-agent"),
    messages: history,
    maxOutputTokens: Number(process.env.MAX_OUTPUT_TOKENS),
    ...forced,
  });
  const errors = [];
  for await (const part of result.fullStream) {
    if (part.type === "tool-error" || part.type === "error") errors.push(String(part.error?.name ?? part.error));
  }
  const calls = (await result.toolCalls).map((c) => ({ name: c.toolName, input: c.input, invalid: !!c.invalid }));
  return { finishReason: await result.finishReason, calls, ran: [...ran], errors };
}

const spliced = await cut(process.env.OPENAI_BASE_URL);
const plain = await cut(process.env.PLAIN_BASE_URL);
console.log(JSON.stringify({ first: first.toolCalls.map((c) => c.input), spliced, plain }));
