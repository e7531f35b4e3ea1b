// Vercel's AI SDK at its defaults (`openai("NAME")`: the Responses API) with a tool forced by toolChoice, no
// `strict`. Before #27 the arguments could be any JSON and the SDK threw ToolChoiceViolationError / a parse error.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, tool } from "ai";
import { z } from "zod";

const openai = createOpenAI({ baseURL: process.env.OPENAI_BASE_URL, apiKey: "unused" });
const getWeather = tool({
  description: "Current weather of a city",
  inputSchema: z.object({ city: z.enum(["Paris", "Rome"]) }),
  execute: async () => "sunny",
});
const failures = [];
for (let seed = 0; seed < 8; seed++) { // a random-weight model may pad the JSON past the token limit on a seed
  try {
    const result = await generateText({
      model: openai("my-agent"),
      tools: { get_weather: getWeather },
      toolChoice: { type: "tool", toolName: "get_weather" },
      prompt: "What is the weather?",
      maxOutputTokens: 48,
      maxRetries: 0,
      seed,
    });
    const calls = result.toolCalls.map((c) => ({ name: c.toolName, input: c.input }));
    if (calls.length > 0) {
      console.log(JSON.stringify({ calls, failures }));
      process.exit(0);
    }
    failures.push(`seed ${seed}: no tool call (${result.finishReason})`);
  } catch (error) {
    failures.push(`seed ${seed}: ${error.name}: ${String(error.message).slice(0, 300)}`);
  }
}
console.error(failures.join("\n"));
process.exit(1);
